# Benchmark suites of the decode area (target_sources(kvferry_bench PRIVATE ...)).
target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/decode_suite.cpp)
if(KVFERRY_WITH_CUDA)
  # The gate that queues a sample's launches before it runs.
  target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/launch_gate.cu)
endif()
