# Benchmark suites of the datapath area (target_sources(kvferry_bench PRIVATE ...)).
target_sources(kvferry_bench PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/copy_suite.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/kernels_suite.cpp
)
if(KVFERRY_WITH_CUDA)
  # Engine-like kernels timed by the copy suite's interference figure; the kernels suite's
  # traffic-shape ceilings.
  target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/copy_victim.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/shape_ceiling.cu)
endif()
