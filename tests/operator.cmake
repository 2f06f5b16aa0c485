# The operator's view (issue 43): the Grafana dashboard and the Prometheus alert rules in deploy/
# read only metrics a running kvferryd exports (a disk tier and, with UCX, a remote tier with a
# peer it moved blocks to); `kvferry top --once` shows the rates of live traffic, and the live view
# runs under a pseudo-terminal, quits on q and on Ctrl-C, and gives the terminal back as it was.
# (The package itself is tested by scripts/test-package.sh, which installs it with dpkg.)
kvferry_add_gtest(operator_metrics_test LABEL integration TIMEOUT 120
  SOURCES integration/operator_metrics_test.cpp
  LIBS kvferry::connector nlohmann_json::nlohmann_json yaml-cpp)
add_dependencies(operator_metrics_test kvferryd)
target_compile_definitions(operator_metrics_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>"
  KVFERRY_SOURCE_DIR="${PROJECT_SOURCE_DIR}" KVFERRY_TEST_WITH_UCX=$<BOOL:${KVFERRY_WITH_UCX}>)
kvferry_add_gtest(operator_top_test LABEL integration TIMEOUT 120
  SOURCES integration/operator_top_test.cpp
  LIBS kvferry::connector util)
add_dependencies(operator_top_test kvferryd kvferry_cli)
target_compile_definitions(operator_top_test PRIVATE
  KVFERRYD_PATH="$<TARGET_FILE:kvferryd>" KVFERRY_CLI_PATH="$<TARGET_FILE:kvferry_cli>")
