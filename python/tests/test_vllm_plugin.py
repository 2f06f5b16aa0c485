"""kvferry.vllm driven as vLLM's OffloadingConnector drives a spec: the scheduler-side manager
(lookup, prepare_store, prepare_load, complete_load) and the worker-side handlers (store GPU ->
kvferry, load kvferry -> GPU) over host tensors, against a real kvferryd. Runs without vLLM (the
plugin's compat module supplies stand-ins of vLLM's base classes); where vllm==0.33.0 is installed,
the same tests run on vLLM's own classes."""

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
    cfg = {"spec_name": "KvferryOffloadingSpec", "spec_module_path": "kvferry.vllm.spec", "kvferry.socket": socket,
           "kvferry.lookup_timeout_ms": 2000}
    cfg.update(extra or {})
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, max_model_len=4096),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=cfg),
    )


def kv_cache_config():
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BS))])


def tensors(layout):
    rng = np.random.default_rng(0)
    page = BS * 2 * 4 * 64 * 2  # 16 tokens, K+V, 4 heads x 64, bf16
    if layout == "cross_layer":  # one tensor, all 3 layers of a block together
        return [rng.integers(1, 255, size=(NUM_BLOCKS, 3 * page), dtype=np.uint8)]
    return [rng.integers(1, 255, size=(NUM_BLOCKS, page), dtype=np.uint8) for _ in range(3)]


def run_jobs(handler, job_id, spec):
    assert handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    done = handler.get_finished()
    ok = [getattr(r, "success", r[1] if isinstance(r, tuple) else None) for r in done]
    ids = [getattr(r, "job_id", r[0] if isinstance(r, tuple) else None) for r in done]
    assert ids == [job_id] and ok == [True], done


def test_byte_geometry_and_keys():
    layers, fmt = byte_geometry(3 * 16 * 2 * 4 * 64 * 2, 16)
    assert fmt == "mha:fp8:1x1:nhd" and layers * 16 * 2 == 3 * 16 * 2 * 4 * 64 * 2
    with pytest.raises(ValueError):
        byte_geometry(17, 16)
    h = b"\x01" * 32
    assert len(block_key(h)) == 16
    assert block_key(h) != block_key(h, rank=1) != block_key(h, tensor=1)
    assert block_key(h) == block_key(h)
    assert compat.hash_bytes(5) == compat.hash_bytes(5) and compat.hash_bytes(b"x") == b"x"
    a = compat.model_fingerprint(vllm_config("s", "org/a"))
    b = compat.model_fingerprint(vllm_config("s", "org/b"))
    assert a != b and "bs16" in a


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_store_then_load_comes_back_byte_for_byte(daemon, layout):
    spec = KvferryOffloadingSpec(vllm_config(daemon.socket), kv_cache_config())
    mgr = spec.get_manager()
    kv = tensors(layout)
    original = [t.copy() for t in kv]
    handlers = list(spec.get_handlers(kv))
    (src0, dst0, store), (src1, dst1, load) = handlers
    assert (src0.medium(), dst0.medium()) == ("GPU", "KVFERRY")
    assert (src1.medium(), dst1.medium()) == ("KVFERRY", "GPU")

    hashes = [bytes([i]) * 32 for i in range(4)]
    assert mgr.lookup(hashes) == 0
    out = mgr.prepare_store(hashes)
    assert out.block_hashes_to_store == hashes and out.block_hashes_evicted == []
    run_jobs(store, 1, (compat.GPULoadStoreSpec([2, 3, 4, 5], (4,)), out.store_spec))
    mgr.complete_store(hashes)
    assert mgr.lookup(hashes) == 4
    assert mgr.lookup(hashes + [b"\xee" * 32]) == 4
    assert mgr.lookup([b"\xee" * 32] + hashes) == 0
    assert mgr.prepare_store(hashes[:2] + [b"\xee" * 32]).block_hashes_to_store == [b"\xee" * 32]

    for t in kv:
        t[:] = 0
    load_spec = mgr.prepare_load(hashes[1:3])
    assert isinstance(load_spec, KvferryLoadStoreSpec)
    run_jobs(load, 2, (load_spec, compat.GPULoadStoreSpec([8, 9], (2,))))
    mgr.complete_load(hashes[1:3])
    for t, o in zip(kv, original):
        assert (t[8] == o[3]).all() and (t[9] == o[4]).all(), "a loaded block differs from the stored one"
        assert not t[0].any() and not t[10].any()


def test_a_failed_load_is_reported_not_raised(daemon):
    spec = KvferryOffloadingSpec(vllm_config(daemon.socket), kv_cache_config())
    (_, _, store), (_, _, load) = list(spec.get_handlers(tensors("cross_layer")))
    assert load.transfer_async(7, (KvferryLoadStoreSpec([b"\x42" * 32]), compat.GPULoadStoreSpec([1], (1,))))
    load.wait({7})
    (r,) = load.get_finished()
    assert getattr(r, "success", None) is False or r == (7, False)


def test_instances_of_one_model_share_and_other_models_do_not(daemon):
    a = KvferryOffloadingSpec(vllm_config(daemon.socket, "org/model-a"), kv_cache_config())
    a2 = KvferryOffloadingSpec(vllm_config(daemon.socket, "org/model-a"), kv_cache_config())
    b = KvferryOffloadingSpec(vllm_config(daemon.socket, "org/model-b"), kv_cache_config())
    (_, _, store), _ = list(a.get_handlers(tensors("cross_layer")))
    hashes = [b"\x07" * 32]
    run_jobs(store, 1, (compat.GPULoadStoreSpec([0], (1,)), KvferryLoadStoreSpec(hashes)))
    assert a2.get_manager().lookup(hashes) == 1
    assert b.get_manager().lookup(hashes) == 0


def test_no_daemon_is_a_miss_never_an_error(tmp_path):
    spec = KvferryOffloadingSpec(vllm_config(str(tmp_path / "none.sock")), kv_cache_config())
    mgr = spec.get_manager()
    t0 = time.monotonic()
    assert mgr.lookup([b"\x01" * 32]) == 0
    assert mgr.prepare_store([b"\x01" * 32]) is None
    mgr.complete_load([b"\x01" * 32])
    assert time.monotonic() - t0 < 1.0


def test_daemon_that_dies_becomes_misses(start_daemon):
    d = start_daemon()
    spec = KvferryOffloadingSpec(vllm_config(d.socket), kv_cache_config())
    mgr = spec.get_manager()
    assert mgr.lookup([b"\x01" * 32]) == 0  # connected, a plain miss
    d.kill()
    t0 = time.monotonic()
    assert mgr.lookup([b"\x01" * 32]) == 0
    assert mgr.prepare_store([b"\x01" * 32]) is None
    assert time.monotonic() - t0 < 1.0
