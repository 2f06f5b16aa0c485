"""kvferry.vllm driven as vLLM's OffloadingConnector drives a spec: the scheduler-side manager
(lookup per block, prepare_store, prepare_load, complete_load) and the worker (submit_store GPU ->
kvferry, submit_load kvferry -> GPU, get_finished, wait) over host arrays, against a real kvferryd.
Runs without vLLM (the plugin's compat module supplies stand-ins of vLLM 0.33.0's classes); where
vllm==0.33.0 is installed the same tests run on vLLM's own classes, and test_vllm_real.py drives
vLLM's own connector code."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvferry.vllm import KvferryOffloadingSpec, block_key, byte_geometry, compat
from kvferry.vllm.spec import KvferryLoadStoreSpec

BS = 16
NUM_BLOCKS = 12


def vllm_config(socket, model="org/model-a", extra=None):
    """An OffloadingConfig-shaped object (what vLLM 0.33.0 hands an OffloadingSpec)."""
    cfg = {"spec_name": "KvferryOffloadingSpec", "spec_module_path": "kvferry.vllm.spec", "kvferry.socket": socket,
           "kvferry.lookup_timeout_ms": 2000}
    cfg.update(extra or {})
    return SimpleNamespace(
        groups=(SimpleNamespace(tokens_per_block=BS, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config=cfg,
        engine_id="e0",
        model=SimpleNamespace(name=model, dtype="bfloat16", max_model_len=4096),
        cache=SimpleNamespace(tokens_per_hash=BS, blocks_per_chunk=1),
        parallel=SimpleNamespace(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
    )


def gpu(ids):
    return compat.GPULoadStoreSpec(list(ids), (len(ids),), (0,))


def key(i):
    return bytes([i]) * 32 + b"\0\0\0\0"  # an OffloadKey: block hash + group 0


HIT, MISS = compat.LookupResult.HIT, compat.LookupResult.MISS


def prefix(mgr, keys):
    """How vLLM's scheduler counts a hit: one lookup per block until the first miss."""
    n = 0
    for k in keys:
        if mgr.lookup(k, None) is not HIT:
            break
        n += 1
    return n


def tensors(layout):
    rng = np.random.default_rng(0)
    page = BS * 2 * 4 * 64 * 2  # 16 tokens, K+V, 4 heads x 64, bf16
    if layout == "cross_layer":  # one tensor, all 3 layers of a block together
        return [rng.integers(1, 255, size=(NUM_BLOCKS, 3 * page), dtype=np.uint8)]
    return [rng.integers(1, 255, size=(NUM_BLOCKS, page), dtype=np.uint8) for _ in range(3)]


def run_job(worker, job_id, store, src, dst):
    assert (worker.submit_store if store else worker.submit_load)(job_id, src, dst)
    worker.wait({job_id})
    done = worker.get_finished()
    assert [(r.job_id, r.success) for r in done] == [(job_id, True)], done


def test_byte_geometry_and_keys():
    layers, fmt = byte_geometry(3 * 16 * 2 * 4 * 64 * 2, 16)
    assert fmt == "mha:fp8:1x1:nhd" and layers * 16 * 2 == 3 * 16 * 2 * 4 * 64 * 2
    with pytest.raises(ValueError):
        byte_geometry(17, 16)
    h = key(1)
    assert len(block_key(h)) == 16
    assert block_key(h) != block_key(h, rank=1) != block_key(h, tensor=1)
    assert block_key(h) == block_key(h)
    assert compat.key_bytes(5) == compat.key_bytes(5) and compat.key_bytes(b"x") == b"x"
    a = compat.model_fingerprint(vllm_config("s", "org/a"))
    b = compat.model_fingerprint(vllm_config("s", "org/b"))
    assert a != b and "bs16" in a


def test_chunks_larger_than_a_block_are_refused():
    with pytest.raises(ValueError):
        KvferryOffloadingSpec(SimpleNamespace(**{**vars(vllm_config("s")),
                                                 "cache": SimpleNamespace(tokens_per_hash=BS, blocks_per_chunk=2)}))


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_store_then_load_comes_back_byte_for_byte(daemon, layout):
    spec = KvferryOffloadingSpec(vllm_config(daemon.socket))
    mgr = spec.get_manager()
    kv = tensors(layout)
    original = [t.copy() for t in kv]
    worker = spec.get_worker(kv)
    assert spec.get_worker(kv) is worker

    keys = [key(i) for i in range(4)]
    other = key(0xEE)
    assert mgr.on_new_request(None) is not None
    assert prefix(mgr, keys) == 0
    out = mgr.prepare_store(keys, None)
    assert out.keys_to_store == keys and out.evicted_keys == []
    run_job(worker, 1, True, gpu([2, 3, 4, 5]), out.store_spec)
    mgr.complete_store(keys, None)
    assert prefix(mgr, keys) == 4
    assert prefix(mgr, keys + [other]) == 4
    assert prefix(mgr, [other] + keys) == 0
    assert mgr.lookup(other, None) is MISS
    assert mgr.prepare_store(keys[:2] + [other], None).keys_to_store == [other]

    for t in kv:
        t[:] = 0
    load_spec = mgr.prepare_load(keys[1:3], None)
    assert isinstance(load_spec, KvferryLoadStoreSpec)
    run_job(worker, 2, False, load_spec, gpu([8, 9]))
    mgr.complete_load(keys[1:3], None)
    for t, o in zip(kv, original):
        assert (t[8] == o[3]).all() and (t[9] == o[4]).all(), "a loaded block differs from the stored one"
        assert not t[0].any() and not t[10].any()


def test_a_failed_load_is_reported_not_raised(daemon):
    spec = KvferryOffloadingSpec(vllm_config(daemon.socket))
    worker = spec.get_worker(tensors("cross_layer"))
    assert worker.submit_load(7, KvferryLoadStoreSpec([key(0x42)]), gpu([1]))
    worker.wait({7})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, False)]
    assert worker.submit_load(8, KvferryLoadStoreSpec([key(1), key(2)]), gpu([1]))  # mismatched: a failure
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(8, False)]


def test_instances_of_one_model_share_and_other_models_do_not(daemon):
    a = KvferryOffloadingSpec(vllm_config(daemon.socket, "org/model-a"))
    a2 = KvferryOffloadingSpec(vllm_config(daemon.socket, "org/model-a"))
    b = KvferryOffloadingSpec(vllm_config(daemon.socket, "org/model-b"))
    run_job(a.get_worker(tensors("cross_layer")), 1, True, gpu([0]), KvferryLoadStoreSpec([key(7)]))
    assert a2.get_manager().lookup(key(7), None) is HIT
    assert b.get_manager().lookup(key(7), None) is MISS


def test_no_daemon_is_a_miss_never_an_error(tmp_path):
    spec = KvferryOffloadingSpec(vllm_config(str(tmp_path / "none.sock")))
    mgr = spec.get_manager()
    t0 = time.monotonic()
    assert mgr.lookup(key(1), None) is MISS
    assert mgr.prepare_store([key(1)], None) is None
    mgr.complete_load([key(1)], None)
    mgr.shutdown()
    assert time.monotonic() - t0 < 1.0


def test_daemon_that_dies_becomes_misses(start_daemon):
    d = start_daemon()
    spec = KvferryOffloadingSpec(vllm_config(d.socket))
    mgr = spec.get_manager()
    assert mgr.lookup(key(1), None) is MISS  # connected, a plain miss
    d.kill()
    t0 = time.monotonic()
    assert mgr.lookup(key(1), None) is MISS
    assert mgr.prepare_store([key(1)], None) is None
    assert time.monotonic() - t0 < 1.0
