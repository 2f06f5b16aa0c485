# Sources of the decode_mla kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
target_sources(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla.cpp)
if(KVFERRY_WITH_CUDA)
  target_sources(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/decode_mla.cu)
endif()
