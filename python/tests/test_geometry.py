"""Loads across geometries from Python against a real kvferryd (CPU backend): 64-token pages into
16-token ones and back (Client.page_map + load_mapped), tensor-parallel head slices as numpy
views, and the errors a bad map gets."""

from __future__ import annotations

import numpy as np
import pytest

import kvferry
import kvferry.errors

LAYERS = 2


def keys(n, salt):
    return [(salt << 64) | (0x2000 + i) for i in range(n)]


def test_page_map_builds_entries_both_ways():
    k, b, p = kvferry.Client.page_map(keys(2, 1), 64, range(8), 16)
    assert b.tolist() == list(range(8)) and p.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert (k[:4] == k[0]).all() and (k[4:] == k[4]).all() and not (k[0] == k[4]).all()
    k, b, p = kvferry.Client.page_map(keys(8, 1), 16, [5, 9], 64)
    assert b.tolist() == [5] * 4 + [9] * 4 and p.tolist() == [0, 1, 2, 3] * 2
    with pytest.raises(kvferry.InvalidArgumentError, match="do not fill"):
        kvferry.Client.page_map(keys(3, 1), 64, range(8), 16)
    with pytest.raises(kvferry.InvalidArgumentError, match="divide"):
        kvferry.Client.page_map(keys(2, 1), 48, range(3), 32)


def test_pages_64_to_16_and_back(client):
    big = client.create_region("big", layers=LAYERS, blocks=4, block_size=64, format="mla_bf16")
    small = client.create_region("small", layers=LAYERS, blocks=16, block_size=16, format="mla_bf16",
                                 layout="layer_major")
    rng = np.random.default_rng(3)
    for b in range(4):
        big.block_bytes_view(b)[:] = rng.integers(0, 256, size=big.block_bytes, dtype=np.uint8)
    k = keys(4, 2)
    client.save(big, k, range(4))
    r = client.load_mapped(small, *kvferry.Client.page_map(k, 64, range(16), 16))
    assert r.done == 16
    for layer in range(LAYERS):
        want = big.layer_view(layer).reshape(4 * 64, -1)
        got = small.layer_view(layer).reshape(16 * 16, -1)
        np.testing.assert_array_equal(got, want)
    # Back: four small pages make one big block.
    sk = keys(16, 3)
    client.save(small, sk, range(16))
    before = big.layer_view(1)[2].copy()
    big.layer_view(0)[:] = 0
    big.layer_view(1)[:] = 0
    client.load_mapped(big, *kvferry.Client.page_map(sk[8:12], 16, [0], 64))
    np.testing.assert_array_equal(big.layer_view(1)[0], before)


def test_a_missing_part_fails_its_region_block_and_leaves_it(client):
    big = client.create_region("big", layers=LAYERS, blocks=1, block_size=64, format="mla_bf16")
    small = client.create_region("small", layers=LAYERS, blocks=4, block_size=16, format="mla_bf16")
    for b in range(4):
        small.block_bytes_view(b)[:] = b + 1
    k = keys(4, 4)
    client.save(small, k[:3], range(3))  # the fourth part is never saved
    big.block_bytes_view(0)[:] = 0xEE
    with pytest.raises(kvferry.NotFoundError) as e:
        client.load_mapped(big, k, [0, 0, 0, 0], [0, 1, 2, 3])
    assert (e.value.statuses != 0).all()
    assert (big.block_bytes_view(0) == 0xEE).all()
    r = client.load_mapped(big, k, [0, 0, 0, 0], [0, 1, 2, 3], check=False)
    assert r.done == 0


def test_tensor_parallel_slices(client):
    full = client.create_region("full", layers=LAYERS, blocks=2, block_size=16, format="mha:bf16:4x32:nhd")
    for layer in range(LAYERS):
        for plane in (False, True):
            v = full.kv_view(layer, plane)
            v[:] = np.arange(v.size, dtype=np.uint16).reshape(v.shape).view(v.dtype) + 7 * layer + plane
    k = keys(2, 5)
    client.save(full, k, [0, 1])
    # Rank 1 of TP 2 holds heads 2..3 in HND order; a plain load maps its heads.
    rank = client.create_region("rank1", layers=LAYERS, blocks=2, block_size=16, format="mha:bf16:2x32:hnd:slice=2/4")
    client.load(rank, k, [1, 0])
    for layer in range(LAYERS):
        for plane in (False, True):
            got = rank.kv_view(layer, plane)  # (blocks, tokens, heads, dim) with the HND strides
            want = full.kv_view(layer, plane)
            np.testing.assert_array_equal(got[1], want[0][:, 2:4, :])
            np.testing.assert_array_equal(got[0], want[1][:, 2:4, :])
    with pytest.raises(kvferry.errors.OutOfRangeError):  # pages of the same size have one part, 0
        client.load_mapped(rank, k[:1], [0], [1])


def test_register_a_buffer_at_an_offset(client):
    """A KV tensor inside a larger allocation registers at its offset (no copy): the views point
    into the buffer there, saves and loads touch only the region's bytes."""
    import ctypes
    import fcntl
    import mmap
    import os

    layers, blocks, bs = 2, 4, 16
    region_bytes = layers * blocks * bs * 1152
    offset = 2 * 4096 + 32
    alloc = (offset + region_bytes + 4095) // 4096 * 4096
    fd = os.memfd_create("kv-at-offset", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, alloc)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        mm = mmap.mmap(fd, alloc)
        buf = np.frombuffer(mm, dtype=np.uint8)
        buf[:] = 0xAB
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        with pytest.raises(kvferry.InvalidArgumentError):  # not a multiple of the 16-byte alignment
            client.register_region("off", layers, blocks, bs, "mla_bf16", base=base, alloc_bytes=alloc, fd=fd,
                                   offset=offset + 8)
        r = client.register_region("off", layers, blocks, bs, "mla_bf16", base=base, alloc_bytes=alloc, fd=fd,
                                   offset=offset)
        assert r.base == base + offset
        region = buf[offset:offset + region_bytes]
        region[:] = np.arange(region_bytes, dtype=np.uint64).astype(np.uint8)
        saved = region.copy()
        k = keys(2, 9)
        client.save(r, k, [0, 1])
        region[:] = 0
        client.load(r, k, [2, 3])
        half = region_bytes // 2
        np.testing.assert_array_equal(region[half:], saved[:half])
        assert (buf[:offset] == 0xAB).all() and (buf[offset + region_bytes:] == 0xAB).all()
        del buf, region
        client.close()
        mm.close()
    finally:
        os.close(fd)
