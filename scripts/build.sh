#!/usr/bin/env bash
# Installs the Debian packages kvferry needs (scripts/setup.sh) and builds into build/.
# Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvferry-ccache}
BUILD=${KVFERRY_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja "$@" >"${BUILD}.configure.log" 2>&1 || { cat "${BUILD}.configure.log"; exit 1; }
grep -A8 "kvferry .* configuration" "${BUILD}.configure.log" || true
cmake --build "$BUILD" -j "$(nproc)"
