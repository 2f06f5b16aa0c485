# Tests of copy_blocks beyond the datapath suite (kvferry_add_gtest(...)).
if(KVFERRY_WITH_CUDA)
  kvferry_add_gtest(copy_blocks_gpu_test LABEL gpu TIMEOUT 300
    SOURCES gpu/copy_blocks_gpu_test.cpp
    LIBS kvferry::kernels)
endif()
kvferry_add_gtest(copy_blocks_unit_test LABEL unit
  SOURCES unit/copy_blocks_split_test.cpp
  LIBS kvferry::kernels)
