"""kvferry as an offloading spec for vLLM's OffloadingConnector.

Select it in vLLM's kv_transfer_config:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvferryOffloadingSpec",
                                    "spec_module_path": "kvferry.vllm.spec",
                                    "kvferry.socket": "/run/kvferry/kvferry.sock"}}'

Scheduler side (KvferryManager): vLLM asks one block at a time; each lookup goes to the daemon's
index, bounded by ``kvferry.lookup_timeout_ms`` (default 5); a daemon that is down or slow is a
miss, never an error inside vLLM (it reconnects at most once a second). Blocks to load are pinned
until complete_load.

Worker side (KvferryWorker): vLLM's canonical KV tensors (int8 (num_blocks, page) views, one per
distinct KV tensor) are registered with the daemon once (a contiguous CUDA tensor by its
allocation's legacy IPC handle and its offset in that allocation, so views inside a larger buffer
need no copy either), then blocks move by id through the daemon's save/load. A tensor that cannot
be registered (host memory that is not a memfd) goes through a daemon-owned region of the same
geometry and a copy per transfer.

Keys: blake2b-128 of vLLM's OffloadKey (block hash + group index), personalized by the worker rank and the tensor index; the
namespace's model part carries model, KV dtype, block size and parallel layout
(compat.model_fingerprint), so instances of one model share blocks and different models never do.
Every region is described as opaque bytes (BYTE_FORMAT, as many "layers" as the block needs), so
the daemon never converts formats for vLLM: what is loaded is byte for byte what was saved.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

import kvferry
from kvferry.errors import KvferryError, TimeoutKvError, UnavailableError

from . import compat
from .compat import LoadStoreSpec, OffloadingManager, OffloadingSpec, OffloadingWorker

log = logging.getLogger("kvferry.vllm")

MEDIUM = "KVFERRY"


class KvferryLoadStoreSpec(LoadStoreSpec):
    """Blocks in kvferry: vLLM's OffloadKeys (block hash + group index), in the order of the GPU
    block ids they pair with; the kvferry keys are derived per rank and tensor."""

    def __init__(self, keys: Iterable[Any]):
        self.keys = [compat.key_bytes(k) for k in keys]

    @property
    def block_hashes(self) -> List[bytes]:
        return self.keys

    @staticmethod
    def medium() -> str:
        return MEDIUM

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"KvferryLoadStoreSpec({len(self.keys)} blocks)"


def block_key(key: Any, rank: int = 0, tensor: int = 0) -> bytes:
    """The 16-byte kvferry key of one vLLM OffloadKey for one worker rank and one KV tensor."""
    person = f"kvf-r{rank}-t{tensor}".encode()[:16]
    return hashlib.blake2b(compat.key_bytes(key), digest_size=16, person=person).digest()


#: Every region of the plugin has this format: the daemon keys namespaces by format family (for
#: mha: the whole format), so one fixed format lets the scheduler's lookups see every tensor's
#: blocks. One fp8 "head" of one element in K and V: 2 opaque bytes per token and layer.
BYTE_FORMAT = "mha:fp8:1x1:nhd"


def byte_geometry(page_bytes: int, block_size: int) -> Tuple[int, str]:
    """(layers, format) describing `page_bytes` per block of `block_size` tokens as opaque bytes."""
    if page_bytes <= 0 or page_bytes % (2 * block_size):
        raise ValueError(f"a block of {page_bytes} bytes does not split into {block_size} tokens x 2 bytes")
    return page_bytes // (2 * block_size), BYTE_FORMAT


def _client_options(extra, config) -> Dict[str, Any]:
    return {
        "socket": extra.get("kvferry.socket"),
        "model": extra.get("kvferry.model") or compat.model_fingerprint(config),
        "tenant": extra.get("kvferry.tenant"),
    }


class KvferryManager(OffloadingManager):
    """The scheduler-side manager: answers from the daemon's index.

    vLLM asks one block at a time (lookup) and stops at the first miss; each answer is one round
    trip bounded by ``lookup_timeout_s``. A daemon that is down, slow or gone answers MISS (and
    prepare_store None: nothing is stored), never an exception inside vLLM; it is looked for again
    at most once every ``reconnect_s``."""

    ANCHOR = "vllm-anchor"

    def __init__(self, client_options: Dict[str, Any], block_size: int, lookup_timeout_s: float = 0.005,
                 reconnect_s: float = 1.0):
        self._opts = dict(client_options)
        self._block_size = block_size
        self._timeout = lookup_timeout_s
        self._reconnect_s = reconnect_s
        self._client: Optional[kvferry.Client] = None
        self._anchor = None
        self._last_try = -1e9
        self._lock = threading.Lock()

    def _connected(self):
        if self._client is not None and self._client.connected():
            return self._client, self._anchor
        self._client = self._anchor = None
        now = time.monotonic()
        if now - self._last_try < self._reconnect_s:
            return None, None
        self._last_try = now
        try:
            c = kvferry.Client(name="vllm-scheduler", **self._opts)
            # Lookups need a region of the namespace's format family: a one-block anchor.
            layers, fmt = byte_geometry(2 * self._block_size, self._block_size)
            self._anchor = c.create_region(self.ANCHOR, layers, 1, self._block_size, fmt)
            self._client = c
        except KvferryError as e:
            log.warning("kvferry: no daemon (%s); every lookup is a miss until it is back", e)
            return None, None
        return self._client, self._anchor

    def _keys(self, keys) -> List[bytes]:
        return [block_key(k) for k in keys]

    def _present(self, keys) -> Optional[np.ndarray]:
        """Which of `keys` the daemon holds, or None when it cannot say in time."""
        with self._lock:
            c, anchor = self._connected()
            if c is None:
                return None
            kk = self._keys(keys)
            if not kk:
                return np.zeros(0, dtype=bool)
            try:
                return np.asarray(c.lookup_async(anchor, kk).wait(self._timeout).hits, dtype=bool)
            except UnavailableError:
                self._client = None
                return None
            except (TimeoutKvError, KvferryError) as e:
                log.debug("kvferry lookup: %s (a miss)", e)
                return None

    def _pin(self, keys, pin: bool) -> None:
        with self._lock:
            c, anchor = self._connected()
            if c is None:
                return
            try:  # a failure here only risks a recompute
                (c.pin if pin else c.unpin)(anchor, self._keys(keys), check=False)
            except KvferryError:
                pass

    def lookup(self, key: Any, req_context: Any = None):
        hits = self._present([key])
        hit = hits is not None and hits.size == 1 and bool(hits[0])
        return compat.LookupResult.HIT if hit else compat.LookupResult.MISS

    def prepare_load(self, keys: Iterable[Any], req_context: Any = None) -> LoadStoreSpec:
        keys = list(keys)
        self._pin(keys, True)  # kept until complete_load
        return KvferryLoadStoreSpec(keys)

    def touch(self, keys: Iterable[Any], req_context: Any = None) -> None:
        return  # the daemon keeps its own LRU order

    def complete_load(self, keys: Iterable[Any], req_context: Any = None) -> None:
        self._pin(list(keys), False)

    def prepare_store(self, keys: Iterable[Any], req_context: Any = None):
        keys = list(keys)
        hits = self._present(keys)
        if hits is None:  # no daemon: nothing can be stored now
            return None
        todo = [k for k, hit in zip(keys, hits) if not hit]
        return compat.PrepareStoreOutput(keys_to_store=todo, store_spec=KvferryLoadStoreSpec(todo), evicted_keys=[])

    def complete_store(self, keys: Iterable[Any], req_context: Any = None, success: bool = True) -> None:
        return  # saved blocks are in the daemon's index once the worker's save completed

    def on_new_request(self, req_context: Any = None):
        return compat.request_context()

    def take_events(self):
        return ()

    def shutdown(self) -> None:
        with self._lock:
            c, self._client, self._anchor = self._client, None, None
        if c is not None:
            try:
                c.close()
            except KvferryError:
                pass


class _Tensor:
    """One of vLLM's KV tensors as a kvferry region: registered (zero copy) or staged."""

    def __init__(self, worker: "_Worker", idx: int, tensor: Any):
        self.idx = idx
        self.tensor = tensor
        c = worker.client
        shape = tuple(tensor.shape)
        num_blocks = shape[0]
        nbytes = _nbytes(tensor)
        page = nbytes // num_blocks
        self.page = page
        layers, fmt = byte_geometry(page, worker.block_size)
        name = f"vllm-{worker.instance}-r{worker.rank}-t{idx}"
        self.staged = True
        if getattr(tensor, "is_cuda", False) and tensor.is_contiguous():  # blocks back to back
            ipc = compat.cuda_ipc_handle(tensor)
            if ipc is not None:
                handle, first, alloc = ipc  # a view inside a larger allocation registers at its offset
                self.region = c.register_region(
                    name, layers, num_blocks, worker.block_size, fmt, base=tensor.data_ptr() - first,
                    alloc_bytes=max(alloc, first + nbytes), backend="cuda_ipc", device=tensor.device.index,
                    ipc_handle=handle, offset=first,
                )
                self.staged = False
        if self.staged:
            self.region = c.create_region(name, layers, num_blocks, worker.block_size, fmt)
            self.rows = _host_rows(tensor, num_blocks)  # (num_blocks, page) uint8 over the tensor
            self.region_rows = [self.region.block_bytes_view(b) for b in range(num_blocks)]
            log.info("kvferry: KV tensor %d is staged through region %s (a copy per transfer)", idx, name)

    def to_region(self, block_ids: List[int]) -> None:
        if self.staged:
            for b in block_ids:
                self.region_rows[b][:] = self.rows[b]

    def from_region(self, block_ids: List[int]) -> None:
        if self.staged:
            for b in block_ids:
                self.rows[b][:] = self.region_rows[b]


def _nbytes(t) -> int:
    if hasattr(t, "nbytes"):
        return int(t.nbytes)
    return int(t.numel() * t.element_size())


def _host_rows(t, num_blocks: int) -> np.ndarray:
    """A (num_blocks, page bytes) uint8 numpy view of a host tensor's memory: writes go to the
    tensor (vLLM's canonical tensors may have a block stride larger than their page)."""
    if hasattr(t, "detach"):  # torch CPU tensor: numpy shares its memory and strides
        t = t.detach()
        if t.dtype.is_floating_point and t.element_size() == 2:
            import torch

            t = t.view(torch.int16)  # bf16/fp16: a same-size integer view numpy understands
        elif str(t.dtype).startswith("torch.float8"):
            import torch

            t = t.view(torch.uint8)
        t = t.numpy()
    a = np.asarray(t)
    if a.ndim == 0 or a.shape[0] != num_blocks:
        raise ValueError(f"a KV tensor of shape {a.shape} does not start with {num_blocks} blocks")
    rows = a.reshape(num_blocks, -1) if a.ndim != 2 else a
    if not np.shares_memory(rows, a) or rows.strides[1] != rows.itemsize:
        raise ValueError("a staged KV tensor's block must be contiguous bytes")
    return rows.view(np.uint8)


class _Worker:
    """The worker's connection and regions, shared by the store and the load handler."""

    def __init__(self, client: kvferry.Client, tensors: List[Any], block_size: int, rank: int, instance: str):
        self.client = client
        self.block_size = block_size
        self.rank = rank
        self.instance = instance
        self.tensors = [_Tensor(self, i, t) for i, t in enumerate(tensors)]


class KvferryWorker(OffloadingWorker):
    """vLLM's worker-side transfers: GPU (or host) KV blocks <-> kvferry, by block id.

    A job that fails (a block no longer held, a daemon gone) is reported as a TransferResult with
    success False, never raised."""

    def __init__(self, worker: _Worker):
        self.w = worker
        self._jobs: Dict[int, Tuple[list, List[int], bool, float, int]] = {}
        self._done: list = []  # finished by wait() or at submit, reported by the next get_finished()

    def _submit(self, job_id: int, gpu, kv, store: bool) -> bool:
        try:
            ids = compat.gpu_block_ids(gpu)
        except NotImplementedError as e:
            log.warning("kvferry: job %d: %s", job_id, e)
            self._done.append(compat.transfer_result(job_id, False))
            return True
        if len(ids) != len(kv.keys):
            log.warning("kvferry: job %d pairs %d block ids with %d keys", job_id, len(ids), len(kv.keys))
            self._done.append(compat.transfer_result(job_id, False))
            return True
        c = self.w.client
        tickets = []
        t0 = time.perf_counter()
        try:
            for t in self.w.tensors:
                keys = [block_key(k, self.w.rank, t.idx) for k in kv.keys]
                if store:
                    t.to_region(ids)
                    tickets.append(c.save_async(t.region, keys, ids, check=False))
                else:
                    tickets.append(c.load_async(t.region, keys, ids, check=False))
        except KvferryError as e:
            log.warning("kvferry: job %d not submitted: %s", job_id, e)
            self._done.append(compat.transfer_result(job_id, False))
            return True
        nbytes = sum(t.page for t in self.w.tensors) * len(ids)
        self._jobs[job_id] = (tickets, ids, store, t0, nbytes)
        return True

    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec, dst_spec, expedited: bool = False) -> bool:
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def _finish(self, job_id: int, timeout: Optional[float]):
        tickets, ids, store, t0, nbytes = self._jobs[job_id]
        if timeout == 0 and not all(t.done() for t in tickets):
            return None
        ok = True
        for t in tickets:
            try:
                ok = t.wait(timeout).ok and ok
            except KvferryError:
                ok = False
        if ok and not store:
            for t in self.w.tensors:
                t.from_region(ids)
        del self._jobs[job_id]
        return compat.transfer_result(job_id, ok, nbytes, time.perf_counter() - t0)

    def get_finished(self) -> list:
        out = []
        for job_id in list(self._jobs):
            r = self._finish(job_id, 0)
            if r is not None:
                out.append(r)
        done, self._done = self._done + out, []
        return done

    def wait(self, job_ids) -> None:
        done = [self._finish(j, None) for j in list(job_ids) if j in self._jobs]
        self._done += [d for d in done if d is not None]

    def shutdown(self) -> None:
        self.wait(set(self._jobs))


class KvferryOffloadingSpec(OffloadingSpec):
    """vLLM's OffloadingConnector spec backed by kvferryd (see the module's doc)."""

    def __init__(self, config):
        super().__init__(config)
        if getattr(self, "blocks_per_chunk", 1) != 1:
            raise ValueError("kvferry's vLLM plugin offloads in vLLM's own block size "
                             "(leave 'block_size' and 'blocks_per_chunk' unset)")
        if len(getattr(config, "groups", ()) or ()) > 1:
            raise ValueError("kvferry's vLLM plugin handles one KV cache group (hybrid models: not yet)")
        self._opts = _client_options(self.extra_config, config)
        self._timeout = float(self.extra_config.get("kvferry.lookup_timeout_ms", 5)) / 1000.0
        self._block_size = compat.config_tokens_per_block(self)
        self._rank = compat.config_rank(config)
        self._manager = None
        self._worker = None

    def get_manager(self) -> KvferryManager:
        if self._manager is None:
            self._manager = KvferryManager(self._opts, self._block_size, self._timeout)
        return self._manager

    def get_worker(self, kv_caches) -> KvferryWorker:
        import os

        if self._worker is None:
            client = kvferry.Client(name=f"vllm-worker-{self._rank}", **self._opts)
            state = _Worker(client, compat.canonical_tensors(kv_caches), self._block_size, self._rank,
                            f"{os.getpid()}-{id(self):x}")
            self._worker = KvferryWorker(state)
        return self._worker
