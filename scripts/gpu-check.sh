#!/usr/bin/env bash
# Run on a GPU machine, from the repository root: configures for the local GPU, builds what the
# machine can build, runs the gpu-labelled tests (then unit and integration), and every
# benchmark suite, writing logs and JSON to OUTDIR.
#   bash scripts/gpu-check.sh OUTDIR [--quick] [--only SUITE[,SUITE]] [--tests REGEX] [--pack] [--bench-only]
# --bench-only builds kvferryd and kvferry-bench only and runs no test (a second call on a warm
#   machine, or one that only measures).
# --tests REGEX selects tests by name (ctest -R over GoogleTest names such as
#   "Shapes/DecodePagedGpu.X/y"), not by target. --pack leaves OUTDIR/gpu-check.log and one
#   OUTDIR/logs.tar.gz instead of a file per log (for transports that limit the file count).
# Header-only dependencies the machine lacks can be carried as .deb files in .gpu-deps/
# (scripts/gpu-deps.sh fetches them); they are unpacked into a private prefix.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: gpu-check.sh OUTDIR [--quick] [--only SUITES] [--tests REGEX]}
shift
QUICK=""
ONLY=""
TESTS=""
PACK=""
BENCH_ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK="--quick" ;;
    --only) ONLY="$2"; shift ;;
    --tests) TESTS="$2"; shift ;;
    --pack) PACK=1 ;;
    --bench-only) BENCH_ONLY=1 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
t0=$(date +%s)
stamp() { echo "[gpu-check +$(( $(date +%s) - t0 ))s] $*"; }

PREFIX=/tmp/kvferry-deps
if ls .gpu-deps/*.deb >/dev/null 2>&1; then
  mkdir -p "$PREFIX"
  for f in .gpu-deps/*.deb; do dpkg -x "$f" "$PREFIX"; done
  export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}"
  # Libraries carried as .debs (UCX, liburing): their pkg-config files name /usr; point them at
  # the prefix, and let the loader and the shell find what was unpacked.
  LIBDIR="$PREFIX/usr/lib/x86_64-linux-gnu"
  if [ -d "$LIBDIR/pkgconfig" ]; then
    sed -i -E "s#^([a-z_]+ ?= ?)/usr(/|\$)#\\1$PREFIX/usr\\2#" "$LIBDIR"/pkgconfig/*.pc
    export PKG_CONFIG_PATH="$LIBDIR/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  fi
  export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH="$PREFIX/usr/bin:$PATH"
fi
# A statically built fio (the disk bench's baseline) may be carried as .gpu-deps/fio.
[ -x .gpu-deps/fio ] && export PATH="$PWD/.gpu-deps:$PATH"
[ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || true
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d . | tr -d ' ')
ARCH=${KVFERRY_CUDA_ARCH:-${CAP:-90}}
[ "$ARCH" = "90" ] && ARCH=90a
stamp "configuring for sm_$ARCH"
GEN="-G Ninja"
command -v ninja >/dev/null || GEN=""
BUILD=build-gpu
cmake -S . -B $BUILD $GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DKVFERRY_WITH_CUDA=ON >"$OUTDIR/configure.log" 2>&1 || { cat "$OUTDIR/configure.log"; exit 1; }
grep -A8 "kvferry .* configuration" "$OUTDIR/configure.log"
stamp "building"
TARGETS=""
[ -n "$BENCH_ONLY" ] && TARGETS="--target kvferryd kvferry_bench"
if ! cmake --build $BUILD -j "$(nproc)" $TARGETS >"$OUTDIR/build.log" 2>&1; then
  grep -E "error|Error" "$OUTDIR/build.log" | head -60
  stamp "BUILD FAILED"
  exit 1
fi
stamp "built"
rc=0
if [ -n "$BENCH_ONLY" ]; then
  stamp "no tests (--bench-only)"
elif [ -n "$TESTS" ]; then
  ctest --test-dir $BUILD -R "$TESTS" --output-on-failure --timeout 300 >"$OUTDIR/ctest-selected.log" 2>&1 || rc=1
  tail -40 "$OUTDIR/ctest-selected.log"
else
  stamp "gpu tests"
  ctest --test-dir $BUILD -L gpu --output-on-failure --timeout 300 >"$OUTDIR/ctest-gpu.log" 2>&1 || rc=1
  grep -E "Failed|SKIPPED|Skipped|tests passed|tests failed" "$OUTDIR/ctest-gpu.log" | tail -40
  stamp "unit + integration tests"
  ctest --test-dir $BUILD -L "unit|integration" -j 8 --output-on-failure --timeout 300 >"$OUTDIR/ctest-cpu.log" 2>&1 || rc=1
  grep -E "\*\*\*Failed|tests passed|tests failed" "$OUTDIR/ctest-cpu.log" | tail -20
fi
# The Python package on this machine's CUDA backend (torch views, save/load), when python3 is
# there. Test-only wheels it lacks can be carried in .dev/whl (pytest and its dependencies, numpy);
# plugins of the machine's own Python (pytest-timeout there wants another pytest) are not loaded.
if [ -z "$TESTS" ] && [ -z "$BENCH_ONLY" ] && command -v python3 >/dev/null; then
  stamp "python package tests"
  PYDEPS=/tmp/kvferry-pydeps
  if ls .dev/whl/*.whl >/dev/null 2>&1; then
    python3 -c "import numpy" 2>/dev/null && WHL=$(ls .dev/whl/*.whl | grep -v numpy) || WHL=$(ls .dev/whl/*.whl)
    python3 -m pip install --quiet --no-index --no-deps --target "$PYDEPS" $WHL >"$OUTDIR/pip.log" 2>&1 || true
  fi
  (cd $BUILD && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONPATH="$PYDEPS:$OLDPWD/python" KVFERRYD="$PWD/bin/kvferryd" \
    KVFERRY_LIBRARY="$PWD/lib/libkvferry.so" python3 -m pytest -q -rs -p no:cacheprovider "$OLDPWD/python/tests") \
    >"$OUTDIR/pytest.log" 2>&1 || rc=1
  tail -15 "$OUTDIR/pytest.log"
fi
SUITES=$($BUILD/bin/kvferry-bench --list 2>/dev/null)
[ -n "$ONLY" ] && SUITES=$(echo "$ONLY" | tr , ' ')
# KVFERRY_BENCH_ARGS_<suite> (e.g. KVFERRY_BENCH_ARGS_disk="--daemon-only") are passed after --,
# KVFERRY_BENCH_TIMEOUT bounds each suite (default 240 s).
for s in $SUITES; do
  stamp "bench $s"
  ARGS_VAR="KVFERRY_BENCH_ARGS_$s"
  EXTRA=${!ARGS_VAR:-}
  timeout "${KVFERRY_BENCH_TIMEOUT:-240}" $BUILD/bin/kvferry-bench "$s" $QUICK --json "$OUTDIR/bench-$s.json" \
    ${EXTRA:+-- $EXTRA} >"$OUTDIR/bench-$s.log" 2>&1 || {
    echo "bench $s exited $?"; rc=1; }
  sed -n '/^== kvferry-bench/,$p' "$OUTDIR/bench-$s.log"
done
stamp "done (rc=$rc)"
if [ -n "$PACK" ]; then
  (cd "$OUTDIR" && tar czf /tmp/kvferry-gpu-logs.tar.gz --exclude gpu-check.log . &&
    find . -type f ! -name gpu-check.log -delete && mv /tmp/kvferry-gpu-logs.tar.gz logs.tar.gz)
fi
exit $rc
