#!/usr/bin/env bash
# Installs every Debian package kvferry needs to build, test and run (idempotent,
# non-interactive), and prints the PATH line that puts nvcc on PATH when the CUDA
# toolkit is present. Safe to run again: apt-get skips what is already installed.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config ccache git
  libucx-dev ucx-utils liburing-dev
  libboost-dev libboost-system-dev
  libyaml-cpp-dev libgtest-dev libgmock-dev
  libsystemd-dev systemd
  libspdlog-dev libfmt-dev libcli11-dev libxxhash-dev libnuma-dev nlohmann-json3-dev libssl-dev
  clang-format clang clang-tidy llvm
  iproute2 procps fio python3-venv etcd-server
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all packages present" >&2
fi
