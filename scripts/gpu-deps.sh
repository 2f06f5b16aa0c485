#!/usr/bin/env bash
# Run here (Debian): downloads the .deb files of the header-only dependencies the GPU machine
# lacks (CLI11, xxHash) into .gpu-deps/ (git-ignored), so that a GPU run can carry them and
# unpack them with `dpkg -x` (scripts/gpu-check.sh does that).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
cd .gpu-deps
for p in libcli11-dev libxxhash-dev; do
  ls ${p}_*.deb >/dev/null 2>&1 || apt-get download "$p" >/dev/null
done
ls -la
