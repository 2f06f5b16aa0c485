# Sources of the decode_mla kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
target_sources(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla.cpp)
if(KVFERRY_WITH_CUDA)
  target_sources(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla.cu)
endif()
if(KVFERRY_WITH_CUDA)
  target_sources(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla_wgmma.cu
                 ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla_seesaw.cu
                 ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla_f8.cu
                 ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla_fp8.cu)
  # The wgmma kernel needs sm_90a code; the launcher offers it only when the build has it.
  if("90a" IN_LIST CMAKE_CUDA_ARCHITECTURES)
    set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla.cu PROPERTIES COMPILE_DEFINITIONS
                                KVFERRY_MLA_WGMMA=1)
  endif()
endif()
