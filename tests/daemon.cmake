# Tests of the daemon area (kvferry_add_gtest(...)).
kvferry_add_gtest(protocol_test LABEL unit
  SOURCES unit/protocol_test.cpp unit/ring_test.cpp
  LIBS kvferry::protocol kvferry::connector)

# Integration: kvferryd in its own process, clients here and in forked children.
kvferry_add_gtest(daemon_integration_test LABEL integration TIMEOUT 120
  SOURCES integration/daemon_test.cpp
  LIBS kvferry::connector kvferry::c)
add_dependencies(daemon_integration_test kvferryd kvferry_cli)
target_compile_definitions(daemon_integration_test PRIVATE
  KVFERRYD_PATH="$<TARGET_FILE:kvferryd>" KVFERRY_CLI_PATH="$<TARGET_FILE:kvferry_cli>")
if(KVFERRY_WITH_SYSTEMD)
  target_compile_definitions(daemon_integration_test PRIVATE KVFERRY_TEST_WITH_SYSTEMD=1)
endif()

# GPU: the CUDA region backends end to end (skips without a device).
kvferry_add_gtest(daemon_gpu_test LABEL gpu TIMEOUT 120
  SOURCES gpu/daemon_gpu_test.cpp
  LIBS kvferry::connector)
add_dependencies(daemon_gpu_test kvferryd)
target_compile_definitions(daemon_gpu_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>")

# Integration: the control plane under hostile clients (tenancy, non-readers, half-sent frames,
# fd exhaustion, quotas); clients as other uids run in forked children (needs root, else skips).
kvferry_add_gtest(hostile_control_test LABEL integration TIMEOUT 120
  SOURCES integration/hostile_control_test.cpp
  LIBS kvferry::connector)
add_dependencies(hostile_control_test kvferryd kvferry_cli)
target_compile_definitions(hostile_control_test PRIVATE
  KVFERRYD_PATH="$<TARGET_FILE:kvferryd>" KVFERRY_CLI_PATH="$<TARGET_FILE:kvferry_cli>")
