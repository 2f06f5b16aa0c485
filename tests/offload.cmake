# Offload and reload through kvferryd (issue 6).
kvferry_add_gtest(offload_integration_test LABEL integration TIMEOUT 180
  SOURCES integration/offload_test.cpp
  LIBS kvferry::connector kvferry::c kvferry::kernels)
add_dependencies(offload_integration_test kvferryd kvferry_cli)
target_compile_definitions(offload_integration_test PRIVATE
  KVFERRYD_PATH="$<TARGET_FILE:kvferryd>" KVFERRY_CLI_PATH="$<TARGET_FILE:kvferry_cli>")

# The same round trip with the CUDA backend (skips without a GPU).
kvferry_add_gtest(offload_gpu_test LABEL gpu TIMEOUT 120
  SOURCES gpu/offload_gpu_test.cpp
  LIBS kvferry::connector kvferry::kernels)
add_dependencies(offload_gpu_test kvferryd)
target_compile_definitions(offload_gpu_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>")

# Wire pieces of the data ops (Hello namespace, arena layouts, C ABI mirrors).
kvferry_add_gtest(offload_wire_test LABEL unit
  SOURCES unit/offload_wire_test.cpp
  LIBS kvferry::protocol kvferry::connector)
