"""The remote tier from Python: two kvferryd processes with static peers on loopback (UCX over
TCP). A prefill client sends blocks to the decode daemon, whose client waits for them and loads
them byte for byte; peers() lists the cluster. Skips where kvferryd was built without UCX."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

import kvferry
from kvferry.errors import STATUS_NAMES

LAYERS, BLOCKS, BS = 2, 8, 16
FMT = "mla_bf16"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def remote_yaml(port: int, ports) -> str:
    peers = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    return (
        "tiers:\n  host:\n    capacity: 64MiB\n  remote:\n"
        f"    listen: 127.0.0.1:{port}\n    peers: [{peers}]\n    transport: tcp\n    timeout: 3s\n"
    )


@pytest.fixture
def pair(start_daemon):
    ports = [free_port(), free_port()]
    try:
        a = start_daemon(remote_yaml(ports[0], ports))
    except RuntimeError as e:
        if "without UCX" in str(e):
            pytest.skip("kvferryd was built without UCX: no remote tier")
        raise
    b = start_daemon(remote_yaml(ports[1], ports))
    return a, b, [f"127.0.0.1:{p}" for p in ports]


def test_send_lands_on_the_peer_and_its_client_sees_it(pair):
    a, b, ids = pair
    keys = [(7 << 64) | (0x2000 + i) for i in range(BLOCKS)]
    with kvferry.Client(socket=a.socket, name="prefill", model="m") as ca, kvferry.Client(
        socket=b.socket, name="decode", model="m"
    ) as cb:
        src = ca.create_region("p", layers=LAYERS, blocks=BLOCKS, block_size=BS, format=FMT)
        dst = cb.create_region("d", layers=LAYERS, blocks=BLOCKS, block_size=BS, format=FMT)
        rng = np.random.default_rng(3)
        want = []
        for i in range(BLOCKS):
            data = rng.integers(1, 256, size=src.block_bytes, dtype=np.uint8)
            src.block_bytes_view(i)[:] = data
            want.append(data)

        got = {}
        waiter = threading.Thread(target=lambda: got.update(r=cb.lookup_wait(dst, keys, wait=20.0)))
        waiter.start()
        r = ca.send(src, keys, list(range(BLOCKS)), peer=ids[1])
        assert r.done == BLOCKS
        waiter.join(25)
        assert not waiter.is_alive()
        assert got["r"].hits.all() and got["r"].prefix == BLOCKS

        cb.load(dst, keys, list(range(BLOCKS)))
        for i in range(BLOCKS):
            assert np.array_equal(dst.block_bytes_view(i), want[i]), i

        # Into the decode engine's own blocks (reversed): no load on B needed.
        land = cb.create_region("land", layers=LAYERS, blocks=BLOCKS, block_size=BS, format=FMT)
        r2 = ca.send(src, keys, list(range(BLOCKS)), peer=ids[1], peer_region=land.id,
                     peer_block_ids=list(reversed(range(BLOCKS))))
        assert r2.done == BLOCKS
        for i in range(BLOCKS):
            assert np.array_equal(land.block_bytes_view(BLOCKS - 1 - i), want[i]), i

        bad = ca.send(src, keys, list(range(BLOCKS)), peer="127.0.0.1:1", check=False)
        assert bad.done == 0
        assert {STATUS_NAMES[int(s)] for s in bad.statuses} == {"not_found"}

        p = cb.peers()
        assert p["healthy"] and p["self"] == ids[1]
        assert {m["id"] for m in p["members"]} == set(ids)
        me = [m for m in p["members"] if m["state"] == "self"]
        assert len(me) == 1


def test_peers_without_a_remote_tier_says_so(client):
    with pytest.raises(kvferry.KvferryError) as e:
        client.peers()
    assert "remote tier" in str(e.value)
