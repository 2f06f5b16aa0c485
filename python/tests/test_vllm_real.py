"""kvferry.vllm against the real vLLM package (vllm==0.33.0; scripts/test-vllm.sh installs it).

vLLM's own code selects and drives the spec, with CPU tensors and a real kvferryd (CPU backend):
- OffloadingSpecFactory loads KvferryOffloadingSpec from spec_name/spec_module_path in
  kv_connector_extra_config (the path `vllm serve --kv-transfer-config` takes);
- the worker side is vLLM's OffloadingConnectorWorker: register_kv_caches() canonicalizes KV
  caches allocated by vLLM's allocate_kv_cache (one backing allocation, per-layer views) and calls
  get_worker(); store jobs go through prepare_store_kv/start_kv_transfers, load jobs through
  start_kv_transfers, completions through get_finished/build_connector_worker_meta;
- the scheduler side is the spec's manager asked one OffloadKey at a time with a ReqContext, as
  vLLM's scheduler does.
Skips with a message when vLLM is not importable (the default test run: test_vllm_plugin.py covers
the plugin's logic there)."""

from __future__ import annotations

import time
from unittest.mock import MagicMock

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed: scripts/test-vllm.sh runs these tests")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
)
from vllm.v1.kv_offload import base as vbase  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvferry.vllm import KvferryOffloadingSpec, compat  # noqa: E402
from kvferry.vllm.spec import KvferryLoadStoreSpec, KvferryWorker  # noqa: E402

BS = 16
NUM_BLOCKS = 12
NUM_LAYERS = 3
HEADS = 2
HEAD_SIZE = 64
DTYPE = torch.bfloat16
PAGE = 2 * BS * HEADS * HEAD_SIZE * 2  # K and V, bf16
LAYERS = tuple(f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS))
WAIT_S = 10.0


def test_the_installed_vllm_is_the_tested_one():
    assert compat.HAVE_VLLM, "kvferry.vllm.compat did not import vLLM's classes"
    assert vllm.__version__.split("+")[0] == compat.TESTED_VLLM


def offloading_config(socket, model="org/model-a", rank=0, extra=None):
    cfg = {"spec_name": "KvferryOffloadingSpec", "spec_module_path": "kvferry.vllm.spec",
           "kvferry.socket": socket, "kvferry.lookup_timeout_ms": 2000}
    cfg.update(extra or {})
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BS, layer_names=LAYERS, group_id=0),),
        worker_kv_bytes_per_block=PAGE * NUM_LAYERS,
        enable_kv_cache_events=False,
        extra_config=cfg,
        engine_id="kvferry-test",
        model=OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=BS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )


def kv_cache_config():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    assert spec.page_size_bytes == PAGE
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=PAGE * NUM_BLOCKS * NUM_LAYERS, layers=list(LAYERS),
                                        layer_stride=PAGE * NUM_BLOCKS, block_stride=PAGE)],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def one_rank_vllm_config():
    """The few fields the worker connector reads (vLLM's own worker tests pass a mock too)."""
    c = MagicMock()
    p = c.parallel_config
    p.tensor_parallel_size = p.world_size = 1
    p.decode_context_parallel_size = p.prefill_context_parallel_size = p.cp_kv_cache_interleave_size = 1
    p.rank = 0
    c.model_config.get_total_num_kv_heads.return_value = HEADS
    return c


def key(i, group=0):
    return vbase.make_offload_key(bytes([i]) * 32, group)


def gpu(ids):
    return vbase.GPULoadStoreSpec(list(ids), group_sizes=(len(ids),), block_indices=(0,))


def prefix(mgr, keys, req="r0"):
    """vLLM's scheduler's count: one lookup per block, under the manager's lock, to the first miss."""
    ctx = vbase.ReqContext(req_id=req)
    n = 0
    with mgr.lock:
        for k in keys:
            r = mgr.lookup(k, ctx)
            assert isinstance(r, vbase.LookupResult)
            if r is not vbase.LookupResult.HIT:
                break
            n += 1
    return n


class Engine:
    """vLLM's worker-side connector over CPU KV caches allocated the way the model runner does."""

    def __init__(self, socket, model="org/model-a"):
        self.config = offloading_config(socket, model)
        self.spec = OffloadingSpecFactory.create_spec(self.config)
        assert isinstance(self.spec, KvferryOffloadingSpec) and isinstance(self.spec, vbase.OffloadingSpec)
        kcc = kv_cache_config()
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBNHC, [BS] * len(kcc.kv_cache_groups))
        assert set(self.kv) == set(LAYERS)
        self.conn = OffloadingConnectorWorker(self.spec, one_rank_vllm_config(), kcc)
        self.conn.register_kv_caches(self.kv)
        assert isinstance(self.conn.worker, KvferryWorker) and isinstance(self.conn.worker, vbase.OffloadingWorker)
        self.recving = set()

    def blocks(self, block_ids):
        """The bytes of the given blocks, layer by layer."""
        return [self.kv[name].view(torch.uint8).reshape(NUM_BLOCKS, -1)[list(block_ids)].clone() for name in LAYERS]

    def fill(self, seed):
        g = torch.Generator().manual_seed(seed)
        for name in LAYERS:
            t = self.kv[name].view(torch.int16)
            t.copy_(torch.randint(-30000, 30000, t.shape, generator=g, dtype=torch.int16))

    def zero(self):
        for name in LAYERS:
            self.kv[name].zero_()

    def run(self, job_id, meta, store: bool):
        """One engine step's connector calls for `meta`, then steps until vLLM reports the job done
        (bounded): returns its success as the worker reported it."""
        if store:
            self.conn.prepare_store_kv(meta)  # deferred to the next step's start, as in vLLM
            self.conn.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
        else:
            self.conn.start_kv_transfers(meta)
        deadline = time.monotonic() + WAIT_S
        results = []
        real_get_finished = self.conn.worker.get_finished

        def spy():
            r = real_get_finished()
            results.extend(r)
            return r

        self.conn.worker.get_finished = spy
        try:
            while time.monotonic() < deadline:
                try:
                    _, recving = self.conn.get_finished(set())
                except AssertionError:  # vLLM 0.33.0 asserts on a failed job
                    break
                self.recving |= recving
                m = self.conn.build_connector_worker_meta()
                if m is not None and job_id in m.completed_jobs:
                    break
                time.sleep(0.005)
        finally:
            self.conn.worker.get_finished = real_get_finished
        mine = [r for r in results if r.job_id == job_id]
        assert mine, f"job {job_id} not reported within {WAIT_S} s"
        return mine[0].success


def store_meta(job_id, ids, keys):
    return OffloadingConnectorMetadata(load_jobs={}, store_jobs={
        job_id: TransferJob(req_id="req-s", src_spec=gpu(ids), dst_spec=KvferryLoadStoreSpec(keys))})


def load_meta(job_id, src_spec, ids, req="req-l"):
    return OffloadingConnectorMetadata(load_jobs={job_id: TransferJob(req_id=req, src_spec=src_spec, dst_spec=gpu(ids))},
                                       store_jobs={})


def test_vllm_drives_store_lookup_and_load_byte_for_byte(daemon):
    e = Engine(daemon.socket)
    mgr = e.spec.get_manager()
    assert isinstance(mgr, vbase.OffloadingManager)
    ctx = vbase.ReqContext(req_id="req-s")
    assert mgr.on_new_request(ctx) is not None

    keys = [key(i) for i in range(4)]
    other = key(0xEE)
    assert prefix(mgr, keys) == 0
    with mgr.lock:
        out = mgr.prepare_store(keys, ctx)
    assert isinstance(out, vbase.PrepareStoreOutput) and out.keys_to_store == keys and out.evicted_keys == []

    e.fill(1)
    stored = e.blocks([2, 3, 4, 5])
    assert e.run(1, store_meta(1, [2, 3, 4, 5], out.keys_to_store), store=True)
    with mgr.lock:
        mgr.complete_store(keys, ctx)

    assert prefix(mgr, keys) == 4
    assert prefix(mgr, keys + [other]) == 4
    assert prefix(mgr, [other] + keys) == 0
    assert prefix(mgr, [key(1, group=1)]) == 0, "another KV cache group's key is another block"
    with mgr.lock:
        assert mgr.prepare_store(keys[:2] + [other], ctx).keys_to_store == [other]

    e.zero()
    lctx = vbase.ReqContext(req_id="req-l")
    with mgr.lock:
        src = mgr.prepare_load(keys[1:3], lctx)
    assert e.run(2, load_meta(2, src, [8, 9]), store=False)
    assert "req-l" in e.recving
    with mgr.lock:
        mgr.complete_load(keys[1:3], lctx)
    back = e.blocks([8, 9])
    for layer in range(NUM_LAYERS):
        assert torch.equal(back[layer][0], stored[layer][1]) and torch.equal(back[layer][1], stored[layer][2]), \
            f"layer {layer}: a loaded block differs from the stored one"
    assert not any(b.any() for b in e.blocks([0, 1, 10, 11])), "a load wrote outside its blocks"
    e.conn.shutdown()
    mgr.shutdown()


def test_a_second_instance_of_the_model_hits_and_loads(daemon):
    a = Engine(daemon.socket, "org/model-a")
    a.fill(2)
    want = a.blocks([0, 1])
    assert a.run(1, store_meta(1, [0, 1], [key(7), key(8)]), store=True)

    b = Engine(daemon.socket, "org/model-a")
    other_model = KvferryOffloadingSpec(offloading_config(daemon.socket, "org/model-b")).get_manager()
    assert prefix(b.spec.get_manager(), [key(7), key(8)]) == 2
    assert prefix(other_model, [key(7)]) == 0
    src = b.spec.get_manager().prepare_load([key(7), key(8)], vbase.ReqContext(req_id="x"))
    assert b.run(5, load_meta(5, src, [10, 11], "x"), store=False)
    got = b.blocks([10, 11])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_load_of_a_block_the_daemon_lacks_is_reported_failed(daemon):
    e = Engine(daemon.socket)
    # vLLM 0.33.0's worker connector asserts success on every job; the plugin's part is to report
    # the failure (not raise, not pretend): checked on the worker the connector was given.
    w = e.conn.worker
    assert w.submit_load(9, KvferryLoadStoreSpec([key(0x42)]), gpu([3]))
    w.wait({9})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(9, False)]


def test_a_daemon_that_is_down_is_a_miss_inside_vllm(tmp_path):
    spec = OffloadingSpecFactory.create_spec(offloading_config(str(tmp_path / "none.sock")))
    mgr = spec.get_manager()
    ctx = vbase.ReqContext(req_id="r")
    t0 = time.monotonic()
    with mgr.lock:
        assert mgr.lookup(key(1), ctx) is vbase.LookupResult.MISS
        assert mgr.prepare_store([key(1)], ctx) is None
        mgr.complete_load([key(1)], ctx)
        mgr.touch([key(1)], ctx)
    assert prefix(mgr, [key(1), key(2)]) == 0
    mgr.shutdown()
    assert time.monotonic() - t0 < 1.0


def test_a_daemon_that_dies_becomes_misses(start_daemon):
    d = start_daemon()
    e = Engine(d.socket)
    mgr = e.spec.get_manager()
    e.fill(3)
    assert e.run(1, store_meta(1, [0], [key(1)]), store=True)
    assert prefix(mgr, [key(1)]) == 1
    d.kill()
    t0 = time.monotonic()
    assert prefix(mgr, [key(1)]) == 0
    with mgr.lock:
        assert mgr.prepare_store([key(2)], vbase.ReqContext(req_id="r")) is None
    assert time.monotonic() - t0 < 1.0
    # the worker reports the store it could not do as failed, within the bound, without raising
    assert e.conn.worker.submit_store(2, gpu([1]), KvferryLoadStoreSpec([key(2)]))
    e.conn.worker.wait({2})
    assert [(r.job_id, r.success) for r in e.conn.worker.get_finished()] == [(2, False)]
    assert time.monotonic() - t0 < 2.0
