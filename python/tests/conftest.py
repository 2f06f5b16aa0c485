"""A real kvferryd (CPU backend) on a temporary socket for each test that asks for one.

KVFERRYD points at the daemon binary (scripts/test-python.sh sets it); else build*/bin/kvferryd of
the source tree is used. KVFERRY_LIBRARY points the package at libkvferry.so the same way.
"""

from __future__ import annotations

import glob
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _find(env: str, pattern: str) -> str:
    p = os.environ.get(env)
    if p:
        return p
    hits = sorted(glob.glob(str(ROOT / pattern)), key=os.path.getmtime, reverse=True)
    if not hits:
        pytest.exit(f"no {pattern} under {ROOT}: build it, or set {env}", returncode=2)
    return hits[0]


KVFERRYD = _find("KVFERRYD", "build*/bin/kvferryd")
os.environ.setdefault("KVFERRY_LIBRARY", _find("KVFERRY_LIBRARY", "build*/lib/libkvferry.so"))


class Daemon:
    """kvferryd in its own process; stop()/kill() end it (bounded)."""

    def __init__(self, extra_yaml: str = "", args=(), capacity: str = "64MiB", backend: str = "cpu"):
        self.dir = tempfile.mkdtemp(prefix="kvferry-py-")
        self.socket = os.path.join(self.dir, "kvferry.sock")
        self.config = os.path.join(self.dir, "kvferry.yaml")
        self.log_path = os.path.join(self.dir, "kvferryd.log")
        with open(self.config, "w") as f:
            f.write(
                f"daemon:\n  socket: {self.socket}\n  socket_mode: 0666\n  log_level: info\n  metrics_listen: \"\"\n  debug_read: true\n"
                f"device:\n  backend: {backend}\n"
            )
            if "tiers:" not in extra_yaml:
                f.write(f"tiers:\n  host:\n    capacity: {capacity}\n")
            f.write(extra_yaml)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([KVFERRYD, "--config", self.config, *args], stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvferryd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(self.socket)
                s.close()
                return
            except OSError:
                time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"kvferryd did not listen within 10 s:\n{self.log()}")

    def log(self) -> str:
        try:
            return open(self.log_path).read()
        except OSError:
            return ""

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def close(self) -> None:
        self.stop()
        self._log.close()
        subprocess.run(["rm", "-rf", self.dir], check=False)


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.close()


@pytest.fixture
def start_daemon():
    """A factory: start_daemon(extra_yaml="", args=(), capacity="64MiB") -> Daemon."""
    made = []

    def make(*a, **kw):
        d = Daemon(*a, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.fixture
def client(daemon):
    import kvferry

    with kvferry.Client(socket=daemon.socket, name="pytest", model="m") as c:
        yield c
