# Loads across geometries (issue 40): page sizes, tensor-parallel head slices, NHD/HND.
kvferry_add_gtest(layouts_geometry_test LABEL unit
  SOURCES unit/layouts_geometry_test.cpp
  LIBS kvferry::layouts)
kvferry_add_gtest(offload_mapped_test LABEL unit
  SOURCES unit/offload_mapped_test.cpp
  LIBS kvferry::store)
