"""The kvferry package against a real kvferryd (CPU backend): every op, bad arguments, views that
alias the region, async tickets, threads, the CLI, and a daemon killed mid-op."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvferry
from kvferry import _lib as L
from kvferry.errors import STATUS_NAMES

LAYERS, BLOCKS, BS = 3, 16, 16
FMT = "mla_bf16"  # 1152 B per token: 576 bf16 elements
BLOCK_BYTES = LAYERS * BS * 1152


def make_region(c, name="r", blocks=BLOCKS, fmt=FMT):
    return c.create_region(name, layers=LAYERS, blocks=blocks, block_size=BS, format=fmt)


def keys(n, salt=0):
    return [(salt << 64) | (0x1000 + i) for i in range(n)]


def fill(r, blocks, seed):
    """Writes a seeded, non-zero pattern into each block (all layers); returns the patterns."""
    rng = np.random.default_rng(seed)
    out = {}
    for b in blocks:
        data = rng.integers(1, 256, size=r.block_bytes, dtype=np.uint8)
        r.block_bytes_view(b)[:] = data
        out[b] = data
    return out


# ---- the library, versions, keys -------------------------------------------------------------


def test_version_and_every_status_name():
    assert f"abi {kvferry.ABI_VERSION}" in kvferry.version()
    lib = L.lib()
    assert lib.kvferry_abi_version() >= kvferry.ABI_VERSION
    for code, name in STATUS_NAMES.items():
        assert lib.kvferry_status_name(code).decode() == name
        assert kvferry.error_class(code).code == code or code == 0
    assert lib.kvferry_status_name(len(STATUS_NAMES)).decode() == "unknown"


def test_keys_as_bytes_ints_and_arrays_agree():
    b = bytes(range(16))
    as_int = int.from_bytes(b, "big")
    a = kvferry.keys_array([b, as_int])
    assert a.shape == (2, 2) and a.dtype == np.uint64
    assert (a[0] == a[1]).all()
    assert a[0, 0] == int.from_bytes(b[:8], "big") and a[0, 1] == int.from_bytes(b[8:], "big")
    assert kvferry.key_bytes(int(a[0, 0]), int(a[0, 1])) == b
    assert (kvferry.keys_array(a) == a).all()
    assert kvferry.keys_array(b).shape == (1, 2)  # one key alone
    assert kvferry.keys_array(np.arange(3, dtype=np.int64))[2, 1] == 2
    assert kvferry.keys_array([2**128 - 1])[0].tolist() == [2**64 - 1, 2**64 - 1]


@pytest.mark.parametrize("bad", [[b"short"], [-1], [2**128], ["abc"], [1.5], np.zeros((2, 3), np.uint64)])
def test_bad_keys_are_invalid_arguments(bad):
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.keys_array(bad)


def test_block_ids_from_sequences_and_arrays():
    assert kvferry.block_ids_array([1, 2]).dtype == np.int64
    assert kvferry.block_ids_array(np.array([1, 2], np.int32)).tolist() == [1, 2]
    assert kvferry.block_ids_array((5,)).tolist() == [5]
    assert kvferry.block_ids_array([]).size == 0
    for bad in ([1.5], [[1, 2]], ["a"]):
        with pytest.raises(kvferry.InvalidArgumentError):
            kvferry.block_ids_array(bad)


# ---- regions and views ------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1, LAYERS - 1])
def test_layer_view_aliases_the_region(client, layer):
    r = make_region(client)
    assert (r.layers, r.blocks, r.block_size, r.format, r.layout) == (LAYERS, BLOCKS, BS, FMT, "block_major")
    assert r.block_bytes == BLOCK_BYTES and r.backend == "memfd"
    v = r.layer_view(layer)
    assert isinstance(v, np.ndarray) and v.dtype == np.uint16  # bf16 bits
    assert v.shape == (BLOCKS, BS, 576)
    assert v.strides == (BLOCK_BYTES, 1152, 2)  # block stride = all layers of a block
    rng = np.random.default_rng(layer)
    v[5, 3, :] = rng.integers(1, 65535, size=576, dtype=np.uint16)
    # the daemon sees the write through its own mapping: the array is the region, not a copy
    offset = 5 * BLOCK_BYTES + layer * BS * 1152 + 3 * 1152
    assert r.debug_read(offset, 1152) == v[5, 3].tobytes()
    # and another view of the same block sees it too
    blk = r.block_bytes_view(5)
    assert np.shares_memory(blk, v) or blk[layer * BS * 1152 + 3 * 1152 :][:1152].tobytes() == v[5, 3].tobytes()
    assert blk[layer * BS * 1152 + 3 * 1152 :][:1152].tobytes() == v[5, 3].tobytes()


def test_mha_views_address_both_planes(client):
    r = client.create_region("mha", layers=2, blocks=4, block_size=16, format="mha:bf16:2x64:nhd")
    k = r.kv_view(1, False)
    v = r.kv_view(1, True)
    assert k.shape == v.shape and k.ctypes.data != v.ctypes.data
    k[...] = 1
    v[...] = 2
    assert (r.layer_view(1) == 1).all()  # layer_view is the K plane
    assert (r.kv_view(1, True) == 2).all()


def test_region_lookup_by_name_and_bad_region_arguments(client):
    r = make_region(client, "named")
    assert client.region("named").id == r.id
    assert any(x.id == r.id for x in client.regions())
    with pytest.raises(kvferry.NotFoundError):
        client.region("no-such-region")
    with pytest.raises(kvferry.KvferryError) as e:
        r.layer_view(LAYERS)
    assert e.value.name == "out_of_range"
    with pytest.raises(kvferry.InvalidArgumentError):
        client.create_region("bad", 2, 4, 16, "mla_fp9")
    with pytest.raises(kvferry.InvalidArgumentError):
        client.create_region("bad", 2, 4, 16, FMT, layout="diagonal")
    with pytest.raises(kvferry.InvalidArgumentError):
        r.block_bytes_view(BLOCKS)


def test_torch_views_when_torch_is_there(client):
    torch = pytest.importorskip("torch", reason="torch is not installed: the torch form of the views is not tested")
    r = make_region(client)
    t = r.layer_view(1, as_="torch")
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (BLOCKS, BS, 576)
    t[2, 0, 0] = 1.5
    assert r.layer_view(1)[2, 0, 0] == np.frombuffer(torch.tensor([1.5], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes(), np.uint16)[0]


# ---- data ops ---------------------------------------------------------------------------------


def test_save_load_round_trip_into_other_blocks(client):
    r = make_region(client)
    src = fill(r, range(0, 6), seed=1)
    k = [kvferry.key_bytes(7, i) for i in range(6)]
    res = client.save(r, k, np.arange(6))
    assert res.ok and res.done == 6 and res.statuses.tolist() == [0] * 6
    for b in range(BLOCKS):
        r.block_bytes_view(b)[:] = 0
    res = client.load(r, k, list(range(10, 16)))
    assert res.done == 6
    for i in range(6):
        assert (r.block_bytes_view(10 + i) == src[i]).all(), f"block {i} came back different"
    assert not r.block_bytes_view(0).any()  # nothing else written


def test_lookup_prefix_and_hits(client):
    r = make_region(client)
    fill(r, range(4), seed=2)
    k = keys(6)
    client.save(r, [k[0], k[1], k[3]], [0, 1, 3])
    res = client.lookup(r, k)
    assert isinstance(res, kvferry.LookupResult)
    assert res.prefix == 2
    assert res.hits.tolist() == [True, True, False, True, False, False]
    assert res.statuses[2] == 5  # not_found: an answer, not an error
    assert client.lookup(r, []).prefix == 0


def test_load_miss_raises_with_per_block_statuses(client):
    r = make_region(client)
    fill(r, [0], seed=3)
    client.save(r, keys(1), [0])
    with pytest.raises(kvferry.NotFoundError) as e:
        client.load(r, keys(3), [4, 5, 6])
    assert e.value.statuses.tolist() == [0, 5, 5]
    assert e.value.done == 1
    assert e.value.failed_blocks().tolist() == [1, 2]
    res = client.load(r, keys(3), [4, 5, 6], check=False)
    assert not res.ok and res.code == 5 and res.done == 1


def test_pin_unpin_evict(client):
    r = make_region(client)
    fill(r, range(4), seed=4)
    k = keys(4)
    client.save(r, k, range(4))
    assert client.pin(r, k[:2]).done == 2
    with pytest.raises(kvferry.BusyError) as e:  # pinned blocks are not evicted
        client.evict(r, k[:3])
    assert e.value.statuses.tolist() == [21, 21, 0]
    assert client.lookup(r, k).hits.tolist() == [True, True, False, True]
    client.unpin(r, k[:2])
    ev = client.evict(r, k[:2])
    assert ev.evicted == 2
    with pytest.raises(kvferry.NotFoundError):
        client.pin(r, k[:1])
    assert client.evict(r, all=True).evicted == 1
    assert client.lookup(r, k).prefix == 0


def test_stats_ls_status(client):
    r = make_region(client)
    fill(r, range(3), seed=5)
    client.save(r, keys(3), range(3))
    s = client.stats()
    assert s["entries"] == 3 and s["blocks_saved"] == 3 and s["clients"] >= 1
    assert s["tiers"] == []  # a host-only daemon runs no lower tier
    rows = client.ls(r)
    assert len(rows) == 3
    assert {row["key"] for row in rows} == {kvferry.key_bytes(0, 0x1000 + i) for i in range(3)}
    assert rows[0]["format"] == FMT and rows[0]["bytes"] == BLOCK_BYTES and rows[0]["namespace"].startswith("m|")
    st = client.status()
    assert any(x["name"] == "r" for x in st["regions"])
    assert any(x["name"] == "pytest" for x in st["clients"])
    assert client.ping() < 1.0


def test_stats_name_the_disk_tier(start_daemon, tmp_path):
    d = start_daemon(
        f"tiers:\n  host:\n    capacity: 8MiB\n  disk:\n    path: {tmp_path}\n    capacity: 64MiB\n"
        "    direct_io: false\n"
    )
    with kvferry.Client(socket=d.socket, model="m") as c:
        r = make_region(c)
        fill(r, range(BLOCKS), seed=12)
        for salt in range(20):  # 20 x 16 blocks of 54 KiB (~17 MiB) through an 8 MiB pool
            c.save(r, keys(BLOCKS, salt), range(BLOCKS))
        s = c.stats()
        assert s["capacity_bytes"] == 8 << 20  # the host's figures where they were
        (disk,) = s["tiers"]
        assert disk["tier"] == "disk" and disk["healthy"] and disk["reason"] == ""
        assert disk["blocks"] > 0 and disk["used_bytes"] > 0 and 0 < disk["capacity_bytes"] <= 64 << 20
        assert disk["io_errors"] == 0 and disk["checksum_failures"] == 0
        assert "peers_live" not in disk and "member" not in disk


def test_bad_data_op_arguments(client):
    r = make_region(client)
    with pytest.raises(kvferry.InvalidArgumentError):
        client.save(r, keys(2), [0])  # lengths differ
    with pytest.raises(kvferry.KvferryError) as e:
        client.save(r, keys(1), [BLOCKS])  # past the region
    assert e.value.code in (1, 2)
    with pytest.raises(kvferry.KvferryError):
        client.save(9999, keys(1), [0])  # no such region
    with pytest.raises(kvferry.InvalidArgumentError):
        client.save(r, keys(1), [[0]])
    big = 1 << 17  # more keys than the arena holds
    with pytest.raises(kvferry.InvalidArgumentError):
        client.lookup(r, np.zeros((big, 2), np.uint64))


def test_async_tickets_wait_done_and_await(client):
    r = make_region(client)
    fill(r, range(8), seed=6)
    tickets = [client.save_async(r, keys(1, salt=i), [i]) for i in range(8)]
    assert all(t.wait().done == 1 for t in tickets)
    t = client.lookup_async(r, keys(1, salt=3))
    deadline = time.monotonic() + 5
    while not t.done():
        assert time.monotonic() < deadline
    assert t.wait().prefix == 1
    assert t.wait().prefix == 1  # a ticket keeps its result

    async def main():
        loads = [client.load_async(r, keys(1, salt=i), [8 + i]) for i in range(8)]
        beat = 0

        async def heartbeat():  # the loop keeps running while the loads are awaited
            nonlocal beat
            for _ in range(3):
                await asyncio.sleep(0)
                beat += 1

        res = await asyncio.gather(*loads, heartbeat())
        return res, beat

    res, beat = asyncio.run(main())
    assert [x.done for x in res[:8]] == [1] * 8 and beat == 3
    for i in range(8):
        assert (r.block_bytes_view(8 + i) == r.block_bytes_view(i)).all()


def test_ticket_of_a_failed_op_raises_on_wait(client):
    r = make_region(client)
    t = client.load_async(r, keys(2, salt=99), [0, 1])
    with pytest.raises(kvferry.NotFoundError) as e:
        t.wait(timeout=5)
    assert e.value.statuses.tolist() == [5, 5]


def test_threads_share_one_client(client):
    r = make_region(client, blocks=64)
    fill(r, range(64), seed=7)
    errors = []

    def worker(t):
        try:
            for i in range(40):
                b = 16 * t + (i % 16)
                k = keys(1, salt=1000 * t + i)
                client.save(r, k, [b])
                assert client.lookup(r, k).prefix == 1
        except Exception as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors


# ---- lifetimes --------------------------------------------------------------------------------


def test_views_outlive_close_and_the_connection_closes_after_them(daemon):
    watcher = kvferry.Client(socket=daemon.socket, name="watcher")
    c = kvferry.Client(socket=daemon.socket, name="holder", model="m")
    r = make_region(c)
    v = r.layer_view(0)
    v[0, 0, :4] = [1, 2, 3, 4]
    c.close()
    assert c.closed
    with pytest.raises(kvferry.ClosedError):
        c.stats()
    assert v[0, 0, :4].tolist() == [1, 2, 3, 4]  # still mapped: the view holds the connection
    assert watcher.stats()["clients"] == 2
    del v, r
    import gc

    gc.collect()
    deadline = time.monotonic() + 5
    while watcher.stats()["clients"] != 1:
        assert time.monotonic() < deadline, "the connection stayed open after its last view went"
        time.sleep(0.01)
    watcher.close()


def test_pins_go_with_the_client(daemon):
    with kvferry.Client(socket=daemon.socket, model="m") as a, kvferry.Client(socket=daemon.socket, model="m") as b:
        r = make_region(a)
        fill(r, [0], seed=8)
        a.save(r, keys(1), [0])
        a.pin(r, keys(1))
        rb = b.region("r")
        with pytest.raises(kvferry.BusyError):
            b.evict(rb, keys(1))
        a.close()
        del r
        deadline = time.monotonic() + 5
        while b.evict(rb, keys(1), check=False).evicted != 1:
            assert time.monotonic() < deadline, "the pin outlived its client"
            time.sleep(0.02)


# ---- a daemon that dies -----------------------------------------------------------------------


def test_daemon_killed_mid_op_fails_within_a_second(start_daemon):
    d = start_daemon(args=["--test-copy-delay-ms", "20000"])
    c = kvferry.Client(socket=d.socket, model="m")
    r = make_region(c)
    fill(r, range(2), seed=9)
    t = c.save_async(r, keys(2), [0, 1])
    time.sleep(0.3)
    assert not t.done()
    t0 = time.monotonic()
    d.kill()
    with pytest.raises(kvferry.UnavailableError) as e:
        t.wait()
    assert time.monotonic() - t0 < 1.0
    assert "lost" in str(e.value)
    assert not c.connected()
    t1 = time.monotonic()
    with pytest.raises(kvferry.UnavailableError):
        c.lookup(r, keys(1))
    with pytest.raises(kvferry.UnavailableError):
        c.save(r, keys(1), [0])
    assert time.monotonic() - t1 < 0.5
    c.close()


def test_awaited_op_fails_when_the_daemon_dies(start_daemon):
    d = start_daemon(args=["--test-copy-delay-ms", "20000"])
    c = kvferry.Client(socket=d.socket, model="m")
    r = make_region(c)

    async def main():
        t = c.save_async(r, keys(1), [0])
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        d.kill()
        with pytest.raises(kvferry.UnavailableError):
            await t
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0
    c.close()


def test_connect_to_nothing_is_unavailable(tmp_path):
    with pytest.raises(kvferry.UnavailableError) as e:
        kvferry.Client(socket=str(tmp_path / "nope.sock"))
    assert "nope.sock" in str(e.value)


# ---- python -m kvferry ------------------------------------------------------------------------


def test_cli_status_stats_ls(daemon, client):
    r = make_region(client)
    fill(r, range(2), seed=10)
    client.save(r, keys(2), [0, 1])
    env = dict(os.environ)

    def run(*args):
        p = subprocess.run(
            [sys.executable, "-m", "kvferry", "--socket", daemon.socket, *args],
            capture_output=True, text=True, timeout=30, env=env,
        )
        assert p.returncode == 0, p.stderr
        return p.stdout

    assert json.loads(run("--json", "stats"))["entries"] == 2
    assert "blocks      2 stored" in run("stats")
    st = json.loads(run("--json", "status"))
    assert st["backend"] == "cpu" and st["regions"]
    assert "regions:" in run("status")
    rows = json.loads(run("--json", "ls"))
    assert len(rows) == 2 and len(rows[0]["key"]) == 32
    assert "2 block(s)" in run("ls")
    p = subprocess.run([sys.executable, "-m", "kvferry", "--socket", daemon.socket + ".x", "stats"],
                       capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 1 and "unavailable" in p.stderr
