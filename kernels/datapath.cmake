# Sources of the datapath kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
target_sources(kvferry_kernels PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cpu/write_cpu.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cpu/gather_cpu.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cpu/convert_cpu.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cpu/copy_blocks_cpu.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cpu/fp4_cpu.cpp
)
target_include_directories(kvferry_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
if(KVFERRY_WITH_CUDA)
  target_sources(kvferry_kernels PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/datapath/engine_select.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/datapath/write.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/datapath/gather.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/datapath/convert.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/copy_blocks.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/fp4.cu
  )
endif()
