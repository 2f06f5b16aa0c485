# Benchmark suites of the daemon area (target_sources(kvferry_bench PRIVATE ...)).
target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/ipc_suite.cpp ${CMAKE_CURRENT_SOURCE_DIR}/roundtrip_suite.cpp)
target_link_libraries(kvferry_bench PRIVATE kvferry::daemon_core kvferry::connector)
