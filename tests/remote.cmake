# The remote tier's building blocks (issue 38): placement, member records and the control-message
# format (unit), membership in a real etcd started by the test, and the UCX transport between two
# processes on loopback and across a network namespace (integration).
kvferry_add_gtest(remote_unit_test LABEL unit
  SOURCES unit/placement_test.cpp unit/remote_wire_test.cpp
  LIBS kvferry::store)
kvferry_add_gtest(membership_integration_test LABEL integration TIMEOUT 120
  SOURCES integration/membership_test.cpp
  LIBS kvferry::store)
if(KVFERRY_WITH_UCX)
  kvferry_add_gtest(ucx_transport_integration_test LABEL integration TIMEOUT 120 SERIAL
    SOURCES integration/ucx_transport_test.cpp
    LIBS kvferry::remote)
endif()
# The remote tier through kvferryd: daemons on loopback as one cache, send, etcd membership.
if(KVFERRY_WITH_UCX)
  kvferry_add_gtest(remote_daemon_test LABEL integration TIMEOUT 300 SERIAL
    SOURCES integration/remote_daemon_test.cpp
    LIBS kvferry::connector kvferry::kernels kvferry::store)
  add_dependencies(remote_daemon_test kvferryd)
  target_compile_definitions(remote_daemon_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>")
endif()
# `kvferry stats` and Client::stats_all naming the remote tier: two daemons with static peers.
if(KVFERRY_WITH_UCX)
  kvferry_add_gtest(remote_stats_test LABEL integration TIMEOUT 120
    SOURCES integration/remote_stats_test.cpp
    LIBS kvferry::connector nlohmann_json::nlohmann_json)
  add_dependencies(remote_stats_test kvferryd kvferry_cli)
  target_compile_definitions(remote_stats_test PRIVATE
    KVFERRYD_PATH="$<TARGET_FILE:kvferryd>" KVFERRY_CLI_PATH="$<TARGET_FILE:kvferry_cli>")
endif()
# GPU: region-to-region sends between two daemons of one host with GPU regions (both on GPU 0 here).
if(KVFERRY_WITH_UCX AND KVFERRY_WITH_CUDA)
  kvferry_add_gtest(remote_local_gpu_test LABEL gpu TIMEOUT 300 SERIAL
    SOURCES gpu/remote_local_gpu_test.cpp
    LIBS kvferry::connector kvferry::kernels)
  add_dependencies(remote_local_gpu_test kvferryd)
  target_compile_definitions(remote_local_gpu_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>")
endif()
