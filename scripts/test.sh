#!/usr/bin/env bash
# The test command: installs what is missing, builds, checks formatting, runs every test.
# GPU-labelled tests skip with a message where there is no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
bash scripts/check-format.sh
BUILD=${KVFERRY_BUILD_DIR:-build}
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)" --timeout 300
# The Python package against the real daemon (a venv under the build folder, pinned packages).
bash scripts/test-python.sh --no-build
# Unit + integration under AddressSanitizer + UndefinedBehaviorSanitizer, the threaded tests under
# ThreadSanitizer (CPU-only builds in build-asan/ and build-tsan/), then clang-tidy over the
# C++ files that changed.
bash scripts/test-sanitizers.sh
# The Debian package from the build above: its contents, then (as root with dpkg) dpkg -i, the
# user, directories, units and config, dpkg -r and dpkg --purge leaving nothing behind.
bash scripts/test-package.sh
bash scripts/tidy.sh
