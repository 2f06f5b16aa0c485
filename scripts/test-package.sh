#!/usr/bin/env bash
# The Debian package: builds it with cpack from the main build (KVFERRY_BUILD_DIR, default build/,
# as scripts/build.sh leaves it; only the packaged targets are brought up to date) and checks its
# contents: stripped binaries, their symbols in kvferry-dbgsym by build id, the conffile. As root
# on a machine with dpkg it then installs it and checks the kvferry user, its directories (owner
# and mode), `systemd-analyze verify` of the installed units, `kvferryd --check-config` of the
# installed config as kvferry, a daemon run as kvferry serving its socket, that a reinstall keeps
# an edited config; then `dpkg -r` (the config, the user and the state stay) and `dpkg --purge`
# (nothing stays: files, directories, user, group, group memberships). Elsewhere it says what it
# skipped and exits 0 after the package checks.
# Refuses (exit 1) to touch a machine where kvferry is installed or the user kvferry exists.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${KVFERRY_BUILD_DIR:-build}
OUT=$ROOT/$BUILD/package
say() { echo "test-package: $*"; }
fail() {
  echo "test-package: FAILED: $*" >&2
  exit 1
}

[ -f "$BUILD/CPackConfig.cmake" ] || fail "no $BUILD/CPackConfig.cmake: run scripts/build.sh first"
cmake --build "$BUILD" -j "$(nproc)" --target kvferryd kvferry_cli kvferry_demo kvferry_bench kvferry_c >/dev/null
rm -rf "$OUT"
cpack --config "$BUILD/CPackConfig.cmake" -G DEB -B "$OUT" >"$OUT.log" 2>&1 || {
  cat "$OUT.log"
  fail "cpack"
}
DEB=$(ls "$OUT"/kvferry_*.deb)
DDEB=$(ls "$OUT"/kvferry-dbgsym_*.ddeb)
unstripped=$(du -cb "$BUILD"/bin/kvferryd "$BUILD"/bin/kvferry "$BUILD"/bin/kvferry-demo "$BUILD"/bin/kvferry-bench \
  "$BUILD"/lib/libkvferry.so.* | tail -1 | cut -f1)
say "$(basename "$DEB") $(($(stat -c %s "$DEB") / 1024)) KiB, $(basename "$DDEB") $(($(stat -c %s "$DDEB") / 1024)) KiB" \
  "(the unstripped binaries: $((unstripped / 1024)) KiB)"

# ---- the package's contents (no root needed) ----
X=$(mktemp -d)
trap 'rm -rf "$X"' EXIT
dpkg-deb -x "$DEB" "$X/deb"
dpkg-deb -e "$DEB" "$X/ctl"
dpkg-deb -x "$DDEB" "$X/dbg"
for f in usr/bin/kvferryd usr/bin/kvferry usr/bin/kvferry-demo usr/bin/kvferry-bench \
  usr/lib/systemd/system/kvferryd.service usr/lib/systemd/system/kvferryd@.service \
  usr/lib/sysusers.d/kvferry.conf usr/lib/tmpfiles.d/kvferry.conf etc/kvferry/kvferry.yaml \
  usr/share/doc/kvferry/grafana/kvferry.json usr/share/doc/kvferry/prometheus/kvferry-alerts.yml; do
  [ -e "$X/deb/$f" ] || fail "the package lacks /$f"
done
[ "$(cat "$X/ctl/conffiles")" = /etc/kvferry/kvferry.yaml ] || fail "conffiles: $(cat "$X/ctl/conffiles")"
for s in postinst prerm postrm; do [ -x "$X/ctl/$s" ] || fail "no executable $s"; done
build_id() { LC_ALL=C readelf -n "$1" | sed -n 's/.*Build ID: \([0-9a-f]*\).*/\1/p'; }
for f in usr/bin/kvferryd usr/bin/kvferry usr/bin/kvferry-demo usr/bin/kvferry-bench usr/lib/libkvferry.so.0.1.0; do
  LC_ALL=C readelf -S "$X/deb/$f" | grep -q '\.debug_info' && fail "/$f still carries debug info"
  id=$(build_id "$X/deb/$f")
  dbg="$X/dbg/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug"
  if [ -z "$id" ] || [ ! -f "$dbg" ]; then fail "no debug symbols for /$f (build id '$id') in kvferry-dbgsym"; fi
  LC_ALL=C readelf -S "$dbg" 2>/dev/null | grep -q '\.debug_info' || fail "$dbg has no .debug_info"
done
debug_files=$(cd "$X/dbg" && find . -name '*.debug' | sed 's|^\.||')
say "contents ok: stripped binaries, their symbols in kvferry-dbgsym, conffile, maintainer scripts"

# ---- install, remove, purge (root and dpkg only) ----
if [ "$(id -u)" -ne 0 ] || ! command -v dpkg >/dev/null; then
  say "SKIPPED the install/remove/purge check: it needs root and dpkg (uid $(id -u))"
  exit 0
fi
if dpkg-query -W -f='${Status}' kvferry 2>/dev/null | grep -qv "not-installed"; then
  fail "kvferry is already installed here (dpkg -l kvferry); this test installs and purges its own copy"
fi
getent passwd kvferry >/dev/null && fail "a user kvferry exists already; this test creates and removes it"
getent group kvferry >/dev/null && fail "a group kvferry exists already; this test creates and removes it"

# dpkg waits for no one: retry while another dpkg/apt holds the lock.
dpkg_do() {
  for _ in $(seq 1 30); do
    if dpkg "$@" </dev/null >"$X/dpkg.log" 2>&1; then return 0; fi
    grep -q "lock" "$X/dpkg.log" || {
      cat "$X/dpkg.log"
      return 1
    }
    sleep 2
  done
  cat "$X/dpkg.log"
  return 1
}
leftovers() {
  find /etc /usr /var /run /opt /srv -xdev -name '*kvferry*' -not -path "$ROOT/*" 2>/dev/null | sort
  grep -h kvferry /etc/passwd /etc/group /etc/shadow /etc/gshadow 2>/dev/null || true
}
leftovers >"$X/before"
daemon_pid=
stop_daemon() {
  kill "$daemon_pid" 2>/dev/null || return 0
  for _ in $(seq 1 100); do
    kill -0 "$daemon_pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "$daemon_pid" 2>/dev/null || true
}
cleanup() {
  # The daemon first: userdel refuses a user that still runs a process.
  [ -n "$daemon_pid" ] && stop_daemon
  if dpkg-query -W -f='${Status}' kvferry 2>/dev/null | grep -qv "not-installed"; then
    echo "test-package: purging what this test installed" >&2
    dpkg --purge kvferry-dbgsym kvferry </dev/null >/dev/null 2>&1 || true
  fi
  rm -rf "$X"
}
trap cleanup EXIT

dpkg_do -i "$DEB" "$DDEB" || fail "dpkg -i"
say "installed $(dpkg-query -W -f='${Package} ${Version} ${Status}' kvferry)"

# The user: a system account without a login, at home in its state directory.
IFS=: read -r _ _ uid gid _ home shell < <(getent passwd kvferry) || fail "no user kvferry after dpkg -i"
[ "$uid" -lt 1000 ] || fail "kvferry is not a system user (uid $uid)"
[ "$home" = /var/lib/kvferry ] || fail "kvferry's home is $home"
case $shell in */nologin | */false) ;; *) fail "kvferry has a login shell: $shell" ;; esac
[ "$(getent group kvferry | cut -d: -f3)" = "$gid" ] || fail "kvferry's primary group is not kvferry"
for g in video render; do
  if getent group "$g" >/dev/null; then
    id -nG kvferry | tr ' ' '\n' | grep -qx "$g" || fail "kvferry is not in $g (the GPU device nodes' group)"
  fi
done
say "user ok: kvferry uid $uid, groups $(id -nG kvferry | tr ' ' ',')"

# Its directories, with their owner and mode.
check_dir() {
  [ -d "$1" ] || fail "$1 missing"
  [ "$(stat -c '%U:%G %a' "$1")" = "kvferry:kvferry $2" ] || fail "$1 is $(stat -c '%U:%G %a' "$1"), want kvferry:kvferry $2"
}
check_dir /run/kvferry 755
check_dir /var/lib/kvferry 750
check_dir /var/lib/kvferry/disk 700
say "directories ok: /run/kvferry 0755, /var/lib/kvferry 0750, /var/lib/kvferry/disk 0700, all kvferry's"

# The installed units, as systemd reads them (offline; systemd need not be PID 1).
if ! command -v systemd-analyze >/dev/null; then
  say "SKIPPED systemd-analyze verify: systemd-analyze is not installed"
elif ! systemd-analyze verify --help >/dev/null 2>&1; then
  say "SKIPPED systemd-analyze verify: systemd-analyze cannot run in this container"
else
  ln -s /usr/lib/systemd/system/kvferryd@.service "$X/kvferryd@0.service"
  for u in /usr/lib/systemd/system/kvferryd.service "$X/kvferryd@0.service"; do
    out=$(systemd-analyze verify "$u" 2>&1) || fail "systemd-analyze verify $u: $out"
    [ -z "$out" ] || fail "systemd-analyze verify $u warns: $out"
  done
  grep -qx 'User=kvferry' /usr/lib/systemd/system/kvferryd.service || fail "kvferryd.service does not run as kvferry"
  say "units ok: systemd-analyze verify kvferryd.service kvferryd@0.service"
fi

# setpriv execs the program itself as kvferry (runuser/su would stay its parent), so $! below is
# kvferryd's pid.
as_kvferry() { setpriv --reuid=kvferry --regid=kvferry --init-groups -- "$@"; }

# The installed config, read by the user that runs the daemon.
as_kvferry /usr/bin/kvferryd --check-config /etc/kvferry/kvferry.yaml >"$X/effective.yaml" ||
  fail "kvferryd --check-config /etc/kvferry/kvferry.yaml (as kvferry)"
say "config ok: kvferryd --check-config /etc/kvferry/kvferry.yaml as kvferry"

# The daemon as kvferry (as the unit starts it, less the sandbox): its socket in /run/kvferry,
# owned by kvferry with daemon.socket_mode, served to root (an admin).
setpriv --reuid=kvferry --regid=kvferry --init-groups -- \
  /usr/bin/kvferryd --config /etc/kvferry/kvferry.yaml --metrics-listen 127.0.0.1:0 >"$X/kvferryd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 100); do
  [ -S /run/kvferry/kvferry.sock ] && break
  kill -0 "$daemon_pid" 2>/dev/null || break
  sleep 0.1
done
[ -S /run/kvferry/kvferry.sock ] || {
  cat "$X/kvferryd.log"
  fail "kvferryd run as kvferry did not serve /run/kvferry/kvferry.sock"
}
[ "$(stat -c '%U:%G %a' /run/kvferry/kvferry.sock)" = "kvferry:kvferry 660" ] ||
  fail "the socket is $(stat -c '%U:%G %a' /run/kvferry/kvferry.sock), want kvferry:kvferry 660"
[ "$(ps -o user= -p "$daemon_pid")" = kvferry ] || fail "kvferryd does not run as kvferry"
/usr/bin/kvferry --socket /run/kvferry/kvferry.sock status >"$X/status.txt" || {
  cat "$X/kvferryd.log"
  fail "kvferry status against the daemon run as kvferry"
}
kill "$daemon_pid"
wait "$daemon_pid" || fail "kvferryd did not exit 0 on SIGTERM: $(cat "$X/kvferryd.log")"
daemon_pid=
rm -f /run/kvferry/kvferry.sock
say "daemon ok: ran as kvferry, socket kvferry:kvferry 0660, $(head -1 "$X/status.txt")"

# An edited config survives a reinstall (dpkg keeps a conffile the operator changed).
echo "# edited by test-package.sh" >>/etc/kvferry/kvferry.yaml
dpkg_do -i "$DEB" || fail "dpkg -i (again)"
tail -1 /etc/kvferry/kvferry.yaml | grep -q "edited by test-package.sh" || fail "the reinstall overwrote the edited config"
ls /etc/kvferry/*.dpkg-* >/dev/null 2>&1 && fail "the reinstall left $(ls /etc/kvferry/*.dpkg-*)"
say "conffile ok: the edited /etc/kvferry/kvferry.yaml survived a reinstall"

# dpkg -r: the programs go; the config, the user and the state stay for a reinstall.
dpkg_do -r kvferry-dbgsym kvferry || fail "dpkg -r"
for f in /usr/bin/kvferryd /usr/bin/kvferry /usr/lib/systemd/system/kvferryd.service /usr/lib/sysusers.d/kvferry.conf \
  /usr/lib/tmpfiles.d/kvferry.conf /usr/lib/libkvferry.so.0 $debug_files; do
  [ ! -e "$f" ] || fail "$f is still there after dpkg -r"
done
[ -f /etc/kvferry/kvferry.yaml ] || fail "dpkg -r removed the config"
getent passwd kvferry >/dev/null || fail "dpkg -r removed the user"
[ -d /var/lib/kvferry ] || fail "dpkg -r removed /var/lib/kvferry"
[ ! -e /run/kvferry ] || fail "/run/kvferry is still there after dpkg -r"
dpkg-query -W -f='${Status}' kvferry | grep -q "config-files" || fail "kvferry is not in config-files state"
say "remove ok: programs gone; config, user and /var/lib/kvferry kept"

# dpkg --purge: nothing stays.
dpkg_do --purge kvferry || fail "dpkg --purge"
getent passwd kvferry >/dev/null && fail "the user kvferry is still there after the purge"
getent group kvferry >/dev/null && fail "the group kvferry is still there after the purge"
grep -qw kvferry /etc/group && fail "kvferry is still a member of a group: $(grep -w kvferry /etc/group)"
leftovers >"$X/after"
if ! diff -u "$X/before" "$X/after" >"$X/diff"; then
  cat "$X/diff"
  fail "the purge left the above behind"
fi
dpkg-query -W kvferry >/dev/null 2>&1 && dpkg-query -W -f='${Status}' kvferry | grep -qv "not-installed" &&
  fail "dpkg still knows kvferry: $(dpkg-query -W -f='${Status}' kvferry)"
say "purge ok: no file, directory, user, group or membership left"
say "ok"
