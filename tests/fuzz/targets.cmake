# The libFuzzer targets: one line each. Read twice: by tests/fuzz/CMakeLists.txt (the main build,
# which registers a bounded CTest run per target) and by standalone/CMakeLists.txt (the clang
# sub-build, which compiles the harness and the MODULES it needs with -fsanitize=fuzzer,address).
#
# kvferry_fuzz_target(NAME
#   SOURCES harness.cpp ...      files under tests/fuzz/ (one defines LLVMFuzzerTestOneInput)
#   MODULES dir ...              module directories to build with clang (e.g. config, connector)
#   LIBS target ...              targets the harness links (e.g. kvferry::config)
#   SEEDS dir ...                seed corpus directories, relative to the source root (read only)
#   [SECONDS n])                 run time of the CTest run (default 20)
#
# A frame-decoder target would read, for example:
#   kvferry_fuzz_target(frame SOURCES fuzz_frame.cpp MODULES connector/protocol
#                       LIBS kvferry::protocol SEEDS tests/fuzz/seeds/frame)

kvferry_fuzz_target(config
  SOURCES fuzz_config.cpp
  MODULES config
  LIBS kvferry::config
  SEEDS tests/fuzz/seeds/config deploy deploy/examples)

kvferry_fuzz_target(frame
  SOURCES fuzz_frame.cpp
  MODULES connector/protocol
  LIBS kvferry::protocol
  SEEDS tests/fuzz/seeds/frame)

kvferry_fuzz_target(ring_request
  SOURCES fuzz_ring_request.cpp
  LIBS kvferry::layouts
  SEEDS tests/fuzz/seeds/ring_request)
