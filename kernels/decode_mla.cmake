# Sources of the decode_mla kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
target_sources(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/cpu.cpp)
if(KVFERRY_WITH_CUDA)
  target_sources(kvferry_kernels PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/launch.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/mma_sync_bf16.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/mma_sync_fp8.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/wgmma_depth_split.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/wgmma_seesaw.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/wgmma_seesaw_e4m3.cu)
  # The wgmma kernels need sm_90a code; the launcher offers them only when the build has it.
  if("90a" IN_LIST CMAKE_CUDA_ARCHITECTURES)
    set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla/launch.cu PROPERTIES COMPILE_DEFINITIONS
                                KVFERRY_MLA_WGMMA=1)
  endif()
endif()
