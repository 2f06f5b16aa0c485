"""Save/load round trip from Python: the package's API against the C ABI called directly.

Starts kvferryd (CPU backend unless --backend says otherwise, a host pool sized for the run), creates
a region of N blocks of B MiB (mha bf16, 8 heads x 128, 16 layers x 16 tokens per MiB), then times
in turn, R rounds each:

  package : Client.save_async / load_async with keys as Python ints, block ids as numpy arrays,
            Tickets waited (what an engine written in Python does);
  c_abi   : kvferry_submit_save / kvferry_submit_load / kvferry_wait_op through ctypes with keys and
            block ids prepared once (the C++ client's path: no Python per block or per key).

Both split the blocks into requests of --per-request blocks with --depth requests in flight. The
ratio package / c_abi (GB/s) is the Python layer's cost; the target is >= 0.95. Prints a table
and, with --json FILE, writes it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import statistics
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the tests' Daemon helper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--block-mib", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-request", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    from conftest import Daemon  # also sets KVFERRY_LIBRARY from the build tree when unset

    import kvferry
    from kvferry import _lib as L

    block_bytes = a.block_mib << 20
    layers, bs = 16 * a.block_mib, 16  # mha:bf16:8x128 = 4096 B per token
    pool = a.blocks * block_bytes + (256 << 20)
    d = Daemon(
        extra_yaml=f"tiers:\n  host:\n    capacity: {pool >> 20}MiB\n",
        capacity=None,
    ) if a.backend == "cpu" else None
    if d is None:
        print("only --backend cpu is set up by this script", file=sys.stderr)
        return 2
    try:
        c = kvferry.Client(socket=d.socket, name="bench", model="bench")
        r = c.create_region("bench", layers=layers, blocks=a.blocks, block_size=bs, format="mha:bf16:8x128:nhd")
        assert r.block_bytes == block_bytes, (r.block_bytes, block_bytes)
        rng = np.random.default_rng(1)
        pattern = rng.integers(1, 256, size=block_bytes, dtype=np.uint8)
        for b in range(a.blocks):  # touch every page once, before any timing
            r.block_bytes_view(b)[:] = pattern
        key_ints = [(0xBE << 120) | i for i in range(a.blocks)]
        ids = np.arange(a.blocks, dtype=np.int64)
        chunks = [(i, min(i + a.per_request, a.blocks)) for i in range(0, a.blocks, a.per_request)]
        lib = L.lib()
        handle = c._handle()
        raw_keys = kvferry.keys_array(key_ints)
        raw_ids = ids.copy()

        def pipelined(submit, wait):
            inflight = []
            for lo, hi in chunks:
                if len(inflight) == a.depth:
                    wait(inflight.pop(0))
                inflight.append(submit(lo, hi))
            for t in inflight:
                wait(t)

        def package(op):
            fn = c.save_async if op == "save" else c.load_async
            pipelined(lambda lo, hi: fn(r, key_ints[lo:hi], ids[lo:hi]), lambda t: t.wait())

        statuses = np.zeros(a.per_request, dtype=np.int16)

        def c_abi(op):
            fn = lib.kvferry_submit_save if op == "save" else lib.kvferry_submit_load
            req = L.c_uint64()
            done = L.c_uint32()

            def submit(lo, hi):
                rc = fn(handle, r.id, raw_keys[lo:].ctypes.data, raw_ids[lo:].ctypes.data, hi - lo, ctypes.byref(req))
                assert rc == 0, lib.kvferry_last_error()
                return req.value, hi - lo

            def wait(t):
                rc = lib.kvferry_wait_op(handle, t[0], 600_000_000, statuses.ctypes.data, t[1], ctypes.byref(done), None)
                assert rc == 0 and done.value == t[1], lib.kvferry_last_error()

            pipelined(submit, wait)

        total = a.blocks * block_bytes
        samples = {(p, op): [] for p in ("package", "c_abi") for op in ("save", "load")}
        for rnd in range(a.rounds):
            order = ("package", "c_abi") if rnd % 2 == 0 else ("c_abi", "package")
            for path in order:
                run = package if path == "package" else c_abi
                c.evict(r, all=True)
                t0 = time.perf_counter()
                run("save")
                samples[(path, "save")].append(total / (time.perf_counter() - t0) / 1e9)
                for b in (0, a.blocks - 1):
                    r.block_bytes_view(b)[:] = 0
                t0 = time.perf_counter()
                run("load")
                samples[(path, "load")].append(total / (time.perf_counter() - t0) / 1e9)
                for b in (0, a.blocks - 1):
                    assert (r.block_bytes_view(b) == pattern).all(), f"block {b} came back wrong"
        rows = []
        print(f"{a.blocks} blocks x {a.block_mib} MiB, {a.per_request} per request, {a.depth} deep, "
              f"median of {a.rounds} rounds, backend {a.backend}")
        print(f"{'op':<6} {'package GB/s':>13} {'C ABI GB/s':>11} {'ratio':>7}")
        for op in ("save", "load"):
            p = statistics.median(samples[("package", op)])
            q = statistics.median(samples[("c_abi", op)])
            rows.append({"op": op, "package_gbps": round(p, 3), "c_abi_gbps": round(q, 3), "ratio": round(p / q, 4),
                         "package_samples": samples[("package", op)], "c_abi_samples": samples[("c_abi", op)]})
            print(f"{op:<6} {p:>13.2f} {q:>11.2f} {p / q:>7.3f}")
        out = {"suite": "python-roundtrip", "blocks": a.blocks, "block_bytes": block_bytes,
               "per_request": a.per_request, "depth": a.depth, "rounds": a.rounds, "backend": a.backend,
               "library": kvferry.library_path(), "version": kvferry.version(), "rows": rows}
        print(json.dumps(out))
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        del r
        c.close()
    finally:
        d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
