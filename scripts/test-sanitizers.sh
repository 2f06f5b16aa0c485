#!/usr/bin/env bash
# Builds kvferry CPU-only under sanitizers and runs its tests there:
#   asan  build-asan: AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer), every
#         `unit` and `integration` test;
#   tsan  build-tsan: ThreadSanitizer, the tests whose code crosses threads (see TSAN_TARGETS).
# Usage: scripts/test-sanitizers.sh [asan] [tsan]    (no argument: both)
# Packages come from scripts/setup.sh (run by scripts/build.sh). Build folders: KVFERRY_ASAN_DIR,
# KVFERRY_TSAN_DIR. The first report in any process (a test, or the kvferryd an integration test
# starts: it is the same sanitized build and inherits these options) aborts that process, and its
# report goes to that process's stderr (the daemon's lands in its log, which the tests print when
# they fail).
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvferry-ccache}
JOBS=$(nproc)
ASAN_DIR=${KVFERRY_ASAN_DIR:-build-asan}
TSAN_DIR=${KVFERRY_TSAN_DIR:-build-tsan}
what=("$@")
[ ${#what[@]} -gt 0 ] || what=(asan tsan)

# Reports are fatal (the process aborts) and carry a stack, in tests, forked children and kvferryd
# alike. LeakSanitizer runs at each process's exit; the stricter ASan checks cost little here.
ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1:detect_leaks=1
ASAN_OPTIONS+=:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1:strict_init_order=1
export ASAN_OPTIONS
export UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:abort_on_error=1:second_deadlock_stack=1

# The test executables built and run under TSan: those whose code crosses threads. The ring and
# the frame protocol (protocol_test: producer and consumer threads), the connector's C ABI
# (c_abi_test), every integration test (kvferryd is built with TSan too: its acceptor, control
# plane, data workers and tiers under real clients), the hostile-client tests, and the store
# in-process (store_test, store_disk_test: index, offload engine, disk I/O threads). The other
# unit tests (layouts, kernels, config) run single-threaded CPU code, which ASan covers.
TSAN_TARGETS='^(protocol_test|c_abi_test|store_test|store_disk_test|.*integration_test|hostile_.*_test)$'

# Tests left out (ctest -E), each with its reason.
# fuzz_*: the libFuzzer targets run, under ASan, in the main build; here they would only skip.
ASAN_EXCLUDE='^fuzz_'
# Under TSan also (both run under ASan):
# - HostileData.RewritingSlotsAndArena...: a thread of the test rewrites ring slots while the
#   test's main thread submits them, a race on purpose (and TSan loses the racer's stack, so no
#   suppression can name it);
# - MembershipEtcd.KilledMember...: forks a member process after the test's own membership threads
#   started, which TSan refuses ("starting new threads after multi-threaded fork is not supported").
TSAN_EXCLUDE='^fuzz_|^HostileData\.RewritingSlotsAndArenaAfterSubmitNeverCrashes$'
TSAN_EXCLUDE+='|^MembershipEtcd\.KilledMemberLeavesWithinTwoTtlAndRejoinsWithNewIncarnation$'

# configure DIR SANITIZERS: a CPU-only build (-O1 -g) without fuzzers (they run under ASan in
# the main build already).
configure() {
  local dir=$1 san=$2
  shift 2
  cmake -S . -B "$dir" -G Ninja -DKVFERRY_WITH_CUDA=OFF -DKVFERRY_BUILD_FUZZERS=OFF \
    -DKVFERRY_SANITIZE="$san" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" \
    >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
}

# test_targets DIR [REGEX]: the test executables (not the GPU ones) whose name matches REGEX.
# Building only these (and what they depend on: kvferryd, the CLI) skips the bench and the demo.
test_targets() {
  ninja -C "$1" -t targets all | sed -n 's/^\([A-Za-z0-9_]*_test\): phony$/\1/p' |
    grep -v '^cmake_' | grep -v '_gpu_test$' | grep -E "${2:-.}" || true
}

# run_ctest DIR EXCLUDE: a test of a target that was not built has no label, so -L leaves it out.
run_ctest() {
  local dir=$1 exclude=$2
  ctest --test-dir "$dir" -L 'unit|integration' ${exclude:+-E "$exclude"} --output-on-failure \
    -j "$JOBS" --timeout 600
}

failed=()
for w in "${what[@]}"; do
  start=$SECONDS
  case $w in
    asan)
      configure "$ASAN_DIR" address,undefined
      # shellcheck disable=SC2046
      cmake --build "$ASAN_DIR" -j "$JOBS" --target $(test_targets "$ASAN_DIR")
      built=$SECONDS
      run_ctest "$ASAN_DIR" "$ASAN_EXCLUDE" || failed+=(asan)
      ;;
    tsan)
      # Without UCX: its libucm overrides madvise, and glibc's madvise of an exiting thread's
      # stack then takes libucm's rwlock through TSan's interceptor, which faults (every
      # kvferryd died at SIGTERM). The UCX transport's own tests run under ASan.
      configure "$TSAN_DIR" thread -DKVFERRY_WITH_UCX=OFF
      # shellcheck disable=SC2046
      cmake --build "$TSAN_DIR" -j "$JOBS" --target $(test_targets "$TSAN_DIR" "$TSAN_TARGETS")
      built=$SECONDS
      run_ctest "$TSAN_DIR" "$TSAN_EXCLUDE" || failed+=(tsan)
      ;;
    *)
      echo "usage: $0 [asan] [tsan]" >&2
      exit 2
      ;;
  esac
  echo "test-sanitizers: $w built in $((built - start)) s, tested in $((SECONDS - built)) s"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "test-sanitizers: tests failed under ${failed[*]}" >&2
  exit 1
fi
