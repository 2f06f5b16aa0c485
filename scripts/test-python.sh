#!/usr/bin/env bash
# The Python package's tests against the real kvferryd (CPU backend): creates a venv under the
# build folder, installs pinned test dependencies and ./python into it, and runs pytest with the
# daemon and libkvferry.so of that build. Builds kvferryd and libkvferry.so first unless
# --no-build is given. Options after -- go to pytest.
#   KVFERRY_BUILD_DIR  build folder (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${KVFERRY_BUILD_DIR:-build}
if [[ "${1:-}" == "--no-build" ]]; then
  shift
else
  if [[ ! -f "$BUILD/build.ninja" ]]; then
    cmake -S . -B "$BUILD" -G Ninja
  fi
  cmake --build "$BUILD" --target kvferryd kvferry_c
fi
[[ "${1:-}" == "--" ]] && shift
VENV="$PWD/$BUILD/py-venv"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check numpy==1.26.4 pytest==8.3.3
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall ./python
export KVFERRYD="$PWD/$BUILD/bin/kvferryd"
export KVFERRY_LIBRARY="$PWD/$BUILD/lib/libkvferry.so"
# Run from outside the source tree so that the installed package is the one tested.
cd "$BUILD"
exec "$VENV/bin/python" -m pytest -q -rs "$OLDPWD/python/tests" "$@"
