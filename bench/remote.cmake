# kvferry-bench remote: the UCX transport between two processes next to ucx_perftest (issue 38).
if(KVFERRY_WITH_UCX)
  target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/remote_suite.cpp)
  target_link_libraries(kvferry_bench PRIVATE kvferry::remote kvferry::connector)
  add_dependencies(kvferry_bench kvferryd)  # the daemon rows run the kvferryd next to it
endif()
