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
  kvferry_add_gtest(kernels_datapath_gpu_test LABEL gpu TIMEOUT 300
    SOURCES gpu/kernels_datapath_gpu_test.cpp
    LIBS kvferry::kernels)
  # The same tests with every engine forced (the default picks one per kernel), so each engine's
  # kernels stay bit-identical to the CPU twins whichever one a launcher picks.
  foreach(engine direct staged)
    gtest_discover_tests(kernels_datapath_gpu_test
      TEST_SUFFIX .${engine}
      DISCOVERY_TIMEOUT 60
      PROPERTIES LABELS gpu TIMEOUT 300 ENVIRONMENT KVFERRY_DATAPATH_ENGINE=${engine})
  endforeach()
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
