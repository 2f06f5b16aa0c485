#!/usr/bin/env bash
# Fails when clang-format would change any tracked C++/CUDA file.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.h' '*.hpp' '*.cpp' '*.cc' '*.cu' '*.cuh' 2>/dev/null || true)
[ -n "$files" ] || exit 0
if ! echo "$files" | xargs clang-format --dry-run --Werror >/tmp/kvferry-format.log 2>&1; then
  grep -E "error:" /tmp/kvferry-format.log | head -20
  echo "check-format: run 'git ls-files \"*.h\" \"*.cpp\" \"*.cu\" | xargs clang-format -i'" >&2
  exit 1
fi
echo "check-format: ok"
