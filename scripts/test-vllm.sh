#!/usr/bin/env bash
# kvferry's vLLM plugin against the real vllm==0.33.0: creates a venv under the build folder
# (vllm-venv), installs vllm==0.33.0 (it pulls torch and CUDA wheels: ~4.6 GB of downloads, ~9.4 GB
# installed; CPU is enough to run the tests), pytest and ./python, and runs
# python/tests/test_vllm_real.py and test_vllm_plugin.py against a real kvferryd (CPU backend).
# Builds kvferryd and libkvferry.so first unless --no-build is given. Options after -- go to pytest.
#   KVFERRY_BUILD_DIR  build folder (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${KVFERRY_BUILD_DIR:-build}
VLLM_VERSION=0.33.0
if [[ "${1:-}" == "--no-build" ]]; then
  shift
else
  if [[ ! -f "$BUILD/build.ninja" ]]; then
    cmake -S . -B "$BUILD" -G Ninja
  fi
  cmake --build "$BUILD" --target kvferryd kvferry_c
fi
[[ "${1:-}" == "--" ]] && shift
VENV="$PWD/$BUILD/vllm-venv"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
start=$(date +%s)
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "vllm==$VLLM_VERSION" pytest==8.3.3
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall ./python
echo "test-vllm: venv ready in $(( $(date +%s) - start )) s"
export KVFERRYD="$PWD/$BUILD/bin/kvferryd"
export KVFERRY_LIBRARY="$PWD/$BUILD/lib/libkvferry.so"
# Run from outside the source tree so that the installed package is the one tested.
cd "$BUILD"
exec "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider \
  "$OLDPWD/python/tests/test_vllm_real.py" "$OLDPWD/python/tests/test_vllm_plugin.py" "$@"
