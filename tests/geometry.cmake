# Loads across geometries (issue 40): page sizes, tensor-parallel head slices, NHD/HND.
kvferry_add_gtest(layouts_geometry_test LABEL unit
  SOURCES unit/layouts_geometry_test.cpp
  LIBS kvferry::layouts)
kvferry_add_gtest(offload_mapped_test LABEL unit
  SOURCES unit/offload_mapped_test.cpp
  LIBS kvferry::store)
# Through kvferryd: pages both ways, TP ranks and a full-head engine, the C ABI, the disk tier.
kvferry_add_gtest(geometry_integration_test LABEL integration TIMEOUT 240
  SOURCES integration/geometry_daemon_test.cpp
  LIBS kvferry::connector kvferry::kernels kvferry::c)
add_dependencies(geometry_integration_test kvferryd)
target_compile_definitions(geometry_integration_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>")
