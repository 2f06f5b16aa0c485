# The disk tier (G3) and the fault wrapper behind the Tier seam (issue 37). Its files go under the
# build directory, which is on a file system with O_DIRECT where /tmp may be tmpfs.
kvferry_add_gtest(store_disk_test LABEL unit TIMEOUT 180
  SOURCES unit/store_disk_test.cpp
  LIBS kvferry::store)
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/disk-test)
target_compile_definitions(store_disk_test PRIVATE KVFERRY_DISK_TEST_ROOT="${CMAKE_BINARY_DIR}/disk-test")
