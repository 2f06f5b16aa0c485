# The data path under hostile clients: kvferryd in its own process, raw clients here.
kvferry_add_gtest(hostile_data_test LABEL integration TIMEOUT 120
  SOURCES integration/hostile_data_test.cpp
  LIBS kvferry::connector)
add_dependencies(hostile_data_test kvferryd)
target_compile_definitions(hostile_data_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>")
