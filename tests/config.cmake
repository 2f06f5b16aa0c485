# Tests of the config module and deploy files (kvferry_add_gtest(...)).
kvferry_add_gtest(config_test LABEL unit
  SOURCES unit/config_test.cpp
  LIBS kvferry::config)

# The repo's YAML files and systemd units, found at run time under the source dir.
kvferry_add_gtest(config_files_test LABEL unit
  SOURCES unit/config_files_test.cpp
  LIBS kvferry::config)
target_compile_definitions(config_files_test PRIVATE KVFERRY_SOURCE_DIR="${PROJECT_SOURCE_DIR}")

add_subdirectory(${CMAKE_CURRENT_SOURCE_DIR}/fuzz ${CMAKE_CURRENT_BINARY_DIR}/fuzz)
