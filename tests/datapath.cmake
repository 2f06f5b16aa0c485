# Tests of the datapath area (kvferry_add_gtest(...)).
kvferry_add_gtest(kernels_datapath_test LABEL unit
  SOURCES unit/kernels_write_test.cpp unit/kernels_convert_test.cpp
  LIBS kvferry::kernels)
