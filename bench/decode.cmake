# Benchmark suites of the decode area (target_sources(kvferry_bench PRIVATE ...)).
target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/decode_suite.cpp)
