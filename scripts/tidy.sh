#!/usr/bin/env bash
# clang-tidy (the checks in .clang-tidy) over the C++ files changed against a base; fails when a
# changed file has a warning (warnings in files that did not change are not shown).
# Usage: scripts/tidy.sh [BASE]
#   BASE: a commit; default `git merge-base HEAD origin/main`, else HEAD~N (N = KVFERRY_TIDY_COMMITS,
#   default 5), else every daemon/, connector/ and config/ file. Uncommitted and untracked files
#   count as changed.
# Uses the CPU-only compile database of build-asan (KVFERRY_ASAN_DIR; configured here if missing):
# clang parses every C++ file there, and no CUDA flags get in its way. A changed header is checked
# through one file of the database that includes it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${KVFERRY_ASAN_DIR:-build-asan}
TIDY=$(command -v clang-tidy || command -v clang-tidy-14 || true)
[ -n "$TIDY" ] || { echo "tidy: clang-tidy not found (apt-get install clang-tidy)" >&2; exit 1; }

if [ ! -f "$DIR/compile_commands.json" ]; then
  cmake -S . -B "$DIR" -G Ninja -DKVFERRY_WITH_CUDA=OFF -DKVFERRY_BUILD_FUZZERS=OFF \
    -DKVFERRY_SANITIZE=address,undefined >"$DIR.configure.log" 2>&1 || { cat "$DIR.configure.log"; exit 1; }
fi

base=${1:-}
if [ -z "$base" ]; then
  base=$(git merge-base HEAD origin/main 2>/dev/null ||
    git rev-parse --verify -q "HEAD~${KVFERRY_TIDY_COMMITS:-5}" || true)
fi
if [ -n "$base" ]; then
  changed=$({ git diff --name-only --diff-filter=ACMR "$base" --; git ls-files --others --exclude-standard; } |
    grep -E '\.(cpp|cc|h|hpp)$' | sort -u || true)
  echo "tidy: files changed since $(git rev-parse --short "$base")"
else
  changed=$(git ls-files 'daemon/*' 'connector/*' 'config/*' | grep -E '\.(cpp|cc|h|hpp)$' || true)
  echo "tidy: no base commit, all daemon/connector/config files"
fi

# The files the database compiles, and for each changed file the one clang-tidy runs on.
db_files=$(python3 -c 'import json,sys; print("\n".join(sorted({e["file"] for e in json.load(open(sys.argv[1]))})))' \
  "$DIR/compile_commands.json")
units=()
checked=()
for f in $changed; do
  [ -f "$f" ] || continue
  case $f in
    *.cpp | *.cc)
      if grep -qxF "$ROOT/$f" <<<"$db_files"; then units+=("$ROOT/$f"); checked+=("$f"); fi
      ;;
    *)
      # Public headers are included as "kvferry/...", private ones by their name.
      inc=${f##*/include/}
      [ "$inc" != "$f" ] || inc=${f##*/}
      # Only files of the same module may include a private header: look there first.
      for u in $(grep -F "/${f%%/*}/" <<<"$db_files") $db_files; do
        if grep -qF "#include \"$inc\"" "$u" 2>/dev/null; then
          units+=("$u")
          checked+=("$f")
          break
        fi
      done
      ;;
  esac
done
if [ ${#checked[@]} -eq 0 ]; then
  echo "tidy: no changed C++ file in the build (CUDA and fuzz harnesses are not in it)"
  exit 0
fi
mapfile -t units < <(printf '%s\n' "${units[@]}" | sort -u)
echo "tidy: ${#checked[@]} changed files through ${#units[@]} translation units"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# One clang-tidy per unit, as many at once as there are cores. g++-only warning flags in the
# database are not clang's business.
printf '%s\n' "${units[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  "'$TIDY' -p '$DIR' --quiet --extra-arg=-Wno-unknown-warning-option '{}' >'$out/'\$(echo '{}' | tr / _).log 2>&1 || true"

# Keep the diagnostics (with their notes and source lines) that point into a changed file, each
# once (a header's come from every unit that includes it).
pattern=$(printf '%s\n' "${checked[@]}" | sed 's/[.[\*^$]/\\&/g; s|^|^'"$ROOT"'/|' | paste -sd'|')
report=$(cat "$out"/*.log | PAT="(${pattern}):[0-9]+:[0-9]+: (warning|error):" awk '
  BEGIN { pat = ENVIRON["PAT"] }
  function flush() { if (key != "" && !(key in seen)) { seen[key] = 1; n++; printf "%s", blk } key = ""; blk = "" }
  /^[^ ].*:[0-9]+:[0-9]+: (warning|error):/ { flush(); if ($0 ~ pat) { key = $0; blk = $0 "\n" } next }
  /^[0-9]+ (warning|error)/ || /^Suppressed / || /^Use -header-filter/ || /^Error while processing/ { flush(); next }
  key != "" { blk = blk $0 "\n" }
  END { flush(); if (n) printf "tidy: %d findings in changed files\n", n }')
if [ -n "$report" ]; then
  echo "$report"
  exit 1
fi
echo "tidy: ok"
