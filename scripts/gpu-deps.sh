#!/usr/bin/env bash
# Run here (Debian): downloads the .deb files of the dependencies the GPU machine lacks (CLI11,
# xxHash, UCX, liburing) into .gpu-deps/ (git-ignored), so that a GPU run can carry them and
# unpack them with `dpkg -x` (scripts/gpu-check.sh does that).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
cd .gpu-deps
# UCX (remote tier, ucx_perftest) and liburing (disk tier) too: gpu-check.sh points their
# pkg-config files and the loader at the unpacked prefix. fio, the disk bench's baseline, has
# too many shared dependencies to carry as a .deb: build it statically from its sources
# (./configure --build-static && make) and copy the binary to .gpu-deps/fio.
for p in libcli11-dev libxxhash-dev libucx0 libucx-dev ucx-utils liburing2 liburing-dev; do
  ls ${p}_*.deb >/dev/null 2>&1 || apt-get download "$p" >/dev/null
done
ls -la
