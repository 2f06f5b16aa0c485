# Sources of the decode_paged kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
target_sources(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_paged/cpu.cpp)
if(KVFERRY_WITH_CUDA)
  # One translation unit per dtype pair so the kernel instantiations build in parallel.
  target_sources(kvferry_kernels PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_paged/launch.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_paged/inst_bf16.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_paged/inst_fp16.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_paged/inst_fp8_bf16q.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_paged/inst_fp8_fp16q.cu)
endif()
