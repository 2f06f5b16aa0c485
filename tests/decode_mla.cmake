# Tests of the decode_mla area (kvferry_add_gtest(...)).
kvferry_add_gtest(decode_mla_unit_test LABEL unit
  SOURCES unit/decode_mla_cpu_test.cpp
  LIBS kvferry::kernels)
if(KVFERRY_WITH_CUDA)
  kvferry_add_gtest(decode_mla_gpu_test LABEL gpu TIMEOUT 300
    SOURCES gpu/decode_mla_gpu_test.cpp
    LIBS kvferry::kernels)
endif()
