#!/usr/bin/env bash
# The main job: installs what is missing, builds, then shows kvferry at work.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
BUILD=${KVFERRY_BUILD_DIR:-build}
echo
echo "== compute backend =="
"$BUILD/bin/kvferry" layout --layers 1 --blocks 1 >/dev/null
echo
echo "== how a DeepSeek-like 61-layer cross-layer MLA cache maps to bytes =="
"$BUILD/bin/kvferry" layout --layers 61 --blocks 1024 --format mla_fp8_ds
echo
"$BUILD/bin/kvferry" layout --layers 61 --blocks 1024 --format mla_fp8_ds --layout layer_major
echo
echo "== a Llama-like MHA cache (K and V planes, HND) =="
"$BUILD/bin/kvferry" layout --layers 32 --blocks 4096 --block-size 16 --format mha:bf16:8x128:hnd
