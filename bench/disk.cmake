# kvferry-bench disk: the disk tier next to fio on the same file system (issue 37).
target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/disk_suite.cpp)
target_link_libraries(kvferry_bench PRIVATE kvferry::store)
