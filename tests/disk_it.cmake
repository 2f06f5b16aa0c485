# The disk tier through kvferryd (issue 37): round trips through a small host pool, kill -9 and
# restart, damaged slots, full disk / EIO / short I/O through --test-disk-faults, the pread/pwrite
# engine, format conversion from disk, ls, /metrics and `kvferry stats` naming the disk.
kvferry_add_gtest(disk_tier_integration_test LABEL integration TIMEOUT 240
  SOURCES integration/disk_tier_test.cpp
  LIBS kvferry::connector kvferry::kernels nlohmann_json::nlohmann_json)
add_dependencies(disk_tier_integration_test kvferryd kvferry_cli)
target_compile_definitions(disk_tier_integration_test PRIVATE
  KVFERRYD_PATH="$<TARGET_FILE:kvferryd>" KVFERRY_CLI_PATH="$<TARGET_FILE:kvferry_cli>")
