# Tests of the datapath area (kvferry_add_gtest(...)).
kvferry_add_gtest(kernels_datapath_test LABEL unit
  SOURCES unit/kernels_write_test.cpp unit/kernels_convert_test.cpp unit/kernels_fastmath_test.cpp
  LIBS kvferry::kernels)
# One test checks the CPU twins' private lookup tables.
target_include_directories(kernels_datapath_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/src)
kvferry_add_gtest(kernels_fp4_test LABEL unit
  SOURCES unit/kernels_fp4_test.cpp
  LIBS kvferry::kernels)
if(KVFERRY_WITH_CUDA)
  # Every test runs with the default engine and with direct and staged forced (a test parameter).
  kvferry_add_gtest(kernels_datapath_gpu_test LABEL gpu TIMEOUT 300
    SOURCES gpu/kernels_datapath_gpu_test.cpp
    LIBS kvferry::kernels)
  kvferry_add_gtest(kernels_fp4_gpu_test LABEL gpu
    SOURCES gpu/kernels_fp4_gpu_test.cpp
    LIBS kvferry::kernels)
  kvferry_add_gtest(kernels_fp8_exhaustive_test LABEL gpu
    SOURCES gpu/kernels_fp8_exhaustive_test.cu
    LIBS kvferry::kernels)
  # The test checks the kernels' private conversion helper.
  target_include_directories(kernels_fp8_exhaustive_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/src)
  target_compile_options(kernels_fp8_exhaustive_test PRIVATE --expt-relaxed-constexpr)
endif()
