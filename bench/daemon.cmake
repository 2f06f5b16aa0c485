# Benchmark suites of the daemon area (target_sources(kvferry_bench PRIVATE ...)).
target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/ipc_suite.cpp ${CMAKE_CURRENT_SOURCE_DIR}/roundtrip_suite.cpp)
target_link_libraries(kvferry_bench PRIVATE kvferry::daemon_core kvferry::connector)
# The roundtrip suite's Python row runs python/bench/roundtrip.py from the source tree.
target_compile_definitions(kvferry_bench PRIVATE KVFERRY_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
