# Tests of the decode_paged area (kvferry_add_gtest(...)).
kvferry_add_gtest(decode_paged_unit_test LABEL unit
  SOURCES unit/decode_paged_cpu_test.cpp
  LIBS kvferry::kernels)
if(KVFERRY_WITH_CUDA)
  kvferry_add_gtest(decode_paged_gpu_test LABEL gpu
    SOURCES gpu/decode_paged_gpu_test.cpp
    LIBS kvferry::kernels)
endif()
