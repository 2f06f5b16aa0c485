#!/usr/bin/env bash
# The main job: installs what is missing, builds, then shows kvferry at work: kvferryd with the
# default configuration (deploy/kvferry.yaml; socket and metrics moved to a temporary directory
# and a free port), an engine-like client that saves KV blocks, wipes its cache, loads them back
# into other blocks (and into a cache of another format) and checks every byte, then the
# daemon's counters.
# Usage: scripts/demo.sh [--no-build] [kvferry-demo options, e.g. --format mla_bf16 --blocks 128]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${KVFERRY_BUILD_DIR:-build}
if [ "${1:-}" = "--no-build" ]; then shift; else bash scripts/build.sh; fi
BIN="$BUILD/bin"
for b in kvferryd kvferry kvferry-demo; do
  [ -x "$BIN/$b" ] || { echo "demo: $BIN/$b is missing (build first)" >&2; exit 1; }
done

echo
echo "== how a DeepSeek-like 61-layer cross-layer MLA cache maps to bytes =="
"$BIN/kvferry" layout --layers 61 --blocks 1024 --format mla_fp8_ds

RUN=$(mktemp -d /tmp/kvferry-demo-XXXXXX)
SOCK="$RUN/kvferry.sock"
DPID=""
cleanup() {
  if [ -n "$DPID" ] && kill -0 "$DPID" 2>/dev/null; then kill -TERM "$DPID" 2>/dev/null || true; fi
  rm -rf "$RUN"
}
trap cleanup EXIT

echo
echo "== kvferryd (deploy/kvferry.yaml; socket $SOCK) =="
"$BIN/kvferryd" --config deploy/kvferry.yaml --socket "$SOCK" --metrics-listen 127.0.0.1:0 >"$RUN/kvferryd.log" 2>&1 &
DPID=$!
for _ in $(seq 1 100); do  # bounded: 10 s
  [ -S "$SOCK" ] && "$BIN/kvferry" --socket "$SOCK" status >/dev/null 2>&1 && break
  kill -0 "$DPID" 2>/dev/null || break
  sleep 0.1
done
if ! "$BIN/kvferry" --socket "$SOCK" status >/dev/null 2>&1; then
  echo "demo: kvferryd did not become ready; its log:" >&2
  cat "$RUN/kvferryd.log" >&2
  exit 1
fi
sed -n 's/^[^ ]* [^ ]* //p' "$RUN/kvferryd.log"

echo
echo "== kvferry-demo: write_mla, save, wipe, load into other blocks, check; load into another format =="
rc=0
"$BIN/kvferry-demo" --socket "$SOCK" --keep "$@" || rc=$?

echo
echo "== kvferry stats =="
"$BIN/kvferry" --socket "$SOCK" stats || true
echo
echo "== kvferry ls --limit 4 =="
"$BIN/kvferry" --socket "$SOCK" ls --limit 4 || true
PORT=$(sed -n 's/.*metrics on .*(port \([0-9]*\)).*/\1/p' "$RUN/kvferryd.log" | head -1)
if [ -n "$PORT" ] && command -v curl >/dev/null; then
  echo
  echo "== /healthz and a few /metrics lines (http://127.0.0.1:$PORT) =="
  curl -s --max-time 2 "http://127.0.0.1:$PORT/healthz" || true
  curl -s --max-time 2 "http://127.0.0.1:$PORT/metrics" | grep -E '^kvferry_(blocks|bytes)_(saved|loaded)_total|^kvferry_lookups_total' || true
fi

echo
echo "== stopping kvferryd (SIGTERM) =="
kill -TERM "$DPID"
for _ in $(seq 1 100); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$DPID" 2>/dev/null; then
  echo "demo: kvferryd did not stop within 10 s" >&2
  kill -KILL "$DPID" || true
  rc=1
fi
DPID=""
tail -n 2 "$RUN/kvferryd.log" | sed -n 's/^[^ ]* [^ ]* //p'
echo
if [ "$rc" -eq 0 ]; then echo "demo: OK"; else echo "demo: FAILED (kvferry-demo exit $rc)"; fi
exit "$rc"
