# Tests of the engine-side connector's C ABI (libkvferry.so) against kvferryd in its own process.
kvferry_add_gtest(c_abi_test LABEL integration TIMEOUT 120
  SOURCES integration/c_abi_test.cpp
  LIBS kvferry::c kvferry::protocol kvferry::layouts)
add_dependencies(c_abi_test kvferryd)
target_compile_definitions(c_abi_test PRIVATE KVFERRYD_PATH="$<TARGET_FILE:kvferryd>")
if(KVFERRY_WITH_CUDA)
  target_link_libraries(c_abi_test PRIVATE CUDA::cudart_static)
  target_compile_definitions(c_abi_test PRIVATE KVFERRY_WITH_CUDA=1)
endif()
