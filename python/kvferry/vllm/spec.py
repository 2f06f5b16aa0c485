"""kvferry as an offloading spec for vLLM's OffloadingConnector.

Select it in vLLM's kv_transfer_config:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvferryOffloadingSpec",
                                    "spec_module_path": "kvferry.vllm.spec",
                                    "kvferry.socket": "/run/kvferry/kvferry.sock"}}'

Scheduler side (KvferryManager): lookups go to the daemon's index, batched per call and bounded by
``kvferry.lookup_timeout_ms`` (default 5); a daemon that is down or slow is a miss, never an error
inside vLLM (it reconnects at most once a second). Blocks to load are pinned until complete_load.

Worker side (KvferryHandler, one per direction): vLLM's KV tensors (one per canonical tensor: one
for cross-layer blocks, one per layer otherwise) are registered with the daemon once (a CUDA
tensor by its legacy IPC handle), then blocks move by id through the daemon's save/load. A tensor
that cannot be registered (host memory that is not a memfd, or a CUDA tensor not at the start of
its allocation) goes through a daemon-owned region of the same geometry and a copy per transfer.

Keys: blake2b-128 of vLLM's block hash, personalized by the worker rank and the tensor index; the
namespace's model part carries model, revision, KV dtype, block size and parallel layout
(compat.model_fingerprint), so instances of one model share blocks and different models never do.
Every region is described as opaque bytes (BYTE_FORMAT, as many "layers" as the block needs), so
the daemon never converts formats for vLLM: what is loaded is byte for byte what was saved.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

import kvferry
from kvferry.errors import KvferryError, TimeoutKvError, UnavailableError

from . import compat
from .compat import GPULoadStoreSpec, LoadStoreSpec, OffloadingHandler, OffloadingManager, OffloadingSpec

log = logging.getLogger("kvferry.vllm")

MEDIUM = "KVFERRY"


class KvferryLoadStoreSpec(LoadStoreSpec):
    """Blocks in kvferry: vLLM's block hashes (the keys are derived per rank and tensor)."""

    def __init__(self, block_hashes: Iterable[Any]):
        self.block_hashes = [compat.hash_bytes(h) for h in block_hashes]

    @staticmethod
    def medium() -> str:
        return MEDIUM

    def __repr__(self) -> str:
        return f"KvferryLoadStoreSpec({len(self.block_hashes)} blocks)"


def block_key(block_hash: bytes, rank: int = 0, tensor: int = 0) -> bytes:
    """The 16-byte kvferry key of one vLLM block hash for one worker rank and one KV tensor."""
    person = f"kvf-r{rank}-t{tensor}".encode()[:16]
    return hashlib.blake2b(compat.hash_bytes(block_hash), digest_size=16, person=person).digest()


#: Every region of the plugin has this format: the daemon keys namespaces by format family (for
#: mha: the whole format), so one fixed format lets the scheduler's lookups see every tensor's
#: blocks. One fp8 "head" of one element in K and V: 2 opaque bytes per token and layer.
BYTE_FORMAT = "mha:fp8:1x1:nhd"


def byte_geometry(page_bytes: int, block_size: int) -> Tuple[int, str]:
    """(layers, format) describing `page_bytes` per block of `block_size` tokens as opaque bytes."""
    if page_bytes <= 0 or page_bytes % (2 * block_size):
        raise ValueError(f"a block of {page_bytes} bytes does not split into {block_size} tokens x 2 bytes")
    return page_bytes // (2 * block_size), BYTE_FORMAT


def _client_options(extra: Dict[str, Any], vllm_config) -> Dict[str, Any]:
    return {
        "socket": extra.get("kvferry.socket"),
        "model": extra.get("kvferry.model") or compat.model_fingerprint(vllm_config),
        "tenant": extra.get("kvferry.tenant"),
    }


class KvferryManager(OffloadingManager):
    """The scheduler-side manager: answers from the daemon's index."""

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
        self._pinned: Dict[bytes, int] = {}
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

    def _keys(self, block_hashes) -> List[bytes]:
        return [block_key(h) for h in block_hashes]

    def _present(self, block_hashes) -> Optional[np.ndarray]:
        with self._lock:
            c, anchor = self._connected()
            if c is None:
                return None
            keys = self._keys(block_hashes)
            if not keys:
                return np.zeros(0, dtype=bool)
            try:
                return c.lookup_async(anchor, keys).wait(self._timeout).hits
            except UnavailableError:
                self._client = None
                return None
            except (TimeoutKvError, KvferryError) as e:
                log.debug("kvferry lookup: %s (a miss)", e)
                return None

    def lookup(self, block_hashes: Iterable[Any]) -> int:
        hits = self._present(list(block_hashes))
        if hits is None or hits.size == 0:
            return 0
        return int(hits.size if hits.all() else np.argmin(hits))

    def prepare_load(self, block_hashes: Iterable[Any]) -> LoadStoreSpec:
        hashes = list(block_hashes)
        with self._lock:
            c, anchor = self._connected()
            if c is not None:
                try:  # keep them until complete_load (a failure here only risks a recompute)
                    c.pin(anchor, self._keys(hashes), check=False)
                except KvferryError:
                    pass
        return KvferryLoadStoreSpec(hashes)

    def complete_load(self, block_hashes: Iterable[Any]) -> None:
        with self._lock:
            c, anchor = self._connected()
            if c is not None:
                try:
                    c.unpin(anchor, self._keys(list(block_hashes)), check=False)
                except KvferryError:
                    pass

    def touch(self, block_hashes: Iterable[Any]) -> None:
        return  # the daemon keeps its own LRU order

    def prepare_store(self, block_hashes: Iterable[Any]):
        hashes = list(block_hashes)
        hits = self._present(hashes)
        if hits is None:  # no daemon: nothing can be stored now
            return None
        todo = [h for h, hit in zip(hashes, hits) if not hit]
        return compat.PrepareStoreOutput(
            block_hashes_to_store=todo, store_spec=KvferryLoadStoreSpec(todo), block_hashes_evicted=[]
        )

    def complete_store(self, block_hashes: Iterable[Any], success: bool = True) -> None:
        return

    def take_events(self):
        return ()


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
        layers, fmt = byte_geometry(page, worker.block_size)
        name = f"vllm-{worker.instance}-r{worker.rank}-t{idx}"
        self.staged = True
        if getattr(tensor, "is_cuda", False):
            handle = compat.cuda_ipc_handle(tensor)
            if handle is not None:
                self.region = c.register_region(
                    name, layers, num_blocks, worker.block_size, fmt, base=tensor.data_ptr(), alloc_bytes=nbytes,
                    backend="cuda_ipc", device=tensor.device.index, ipc_handle=handle,
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
    if hasattr(t, "detach"):  # torch CPU tensor: a uint8 numpy view of the same memory
        t = t.detach().contiguous().view(-1).numpy().view(np.uint8)
    a = np.asarray(t)
    if not a.flags.c_contiguous:
        raise ValueError("a staged KV tensor must be contiguous")
    return a.reshape(-1).view(np.uint8).reshape(num_blocks, -1)


class _Worker:
    """The worker's connection and regions, shared by the store and the load handler."""

    def __init__(self, client: kvferry.Client, tensors: List[Any], block_size: int, rank: int, instance: str):
        self.client = client
        self.block_size = block_size
        self.rank = rank
        self.instance = instance
        self.tensors = [_Tensor(self, i, t) for i, t in enumerate(tensors)]


class KvferryHandler(OffloadingHandler):
    """Moves blocks between vLLM's KV tensors and kvferry (one direction per handler)."""

    def __init__(self, worker: _Worker, store: bool):
        self.w = worker
        self.store = store
        self._jobs: Dict[int, Tuple[list, List[int], float, int]] = {}
        self._done: list = []  # finished by wait(), reported by the next get_finished()

    def transfer_async(self, job_id: int, spec) -> bool:
        src, dst = spec
        gpu, kv = (src, dst) if self.store else (dst, src)
        ids = compat.gpu_block_ids(gpu)
        if len(ids) != len(kv.block_hashes):
            log.warning("kvferry: %d block ids for %d hashes", len(ids), len(kv.block_hashes))
            return False
        c = self.w.client
        tickets = []
        try:
            for t in self.w.tensors:
                keys = [block_key(h, self.w.rank, t.idx) for h in kv.block_hashes]
                if self.store:
                    t.to_region(ids)
                    tickets.append(c.save_async(t.region, keys, ids, check=False))
                else:
                    tickets.append(c.load_async(t.region, keys, ids, check=False))
        except KvferryError as e:
            log.warning("kvferry: transfer %d not submitted: %s", job_id, e)
            return False
        nbytes = sum(t.region.block_bytes for t in self.w.tensors) * len(ids)
        self._jobs[job_id] = (tickets, ids, time.perf_counter(), nbytes)
        return True

    def _finish(self, job_id: int, timeout: Optional[float]):
        tickets, ids, t0, nbytes = self._jobs[job_id]
        ok = True
        for t in tickets:
            if timeout == 0 and not t.done():
                return None
            try:
                ok = t.wait(timeout).ok and ok
            except KvferryError:
                ok = False
        if ok and not self.store:
            for t in self.w.tensors:
                t.from_region(ids)
        del self._jobs[job_id]
        kind = ("GPU", MEDIUM) if self.store else (MEDIUM, "GPU")
        return compat.transfer_result(job_id, ok, nbytes, time.perf_counter() - t0, kind)

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

    def __init__(self, vllm_config, kv_cache_config=None):
        super().__init__(vllm_config, kv_cache_config)
        if any(f != 1 for f in getattr(self, "block_size_factors", (1,))):
            raise ValueError("kvferry's vLLM plugin offloads in vLLM's own block size (leave 'block_size' unset)")
        self._opts = _client_options(self.extra_config, vllm_config)
        self._timeout = float(self.extra_config.get("kvferry.lookup_timeout_ms", 5)) / 1000.0
        self._manager = None
        self._worker = None

    # vLLM asks for one region holding all layers where the attention backend allows it.
    prefer_cross_layer_blocks = True

    def get_manager(self) -> KvferryManager:
        if self._manager is None:
            self._manager = KvferryManager(self._opts, self.gpu_block_size[0], self._timeout)
        return self._manager

    def get_handlers(self, kv_caches, attn_backends=None) -> Iterator[tuple]:
        import os

        if self._worker is None:
            rank = int(getattr(getattr(self.vllm_config, "parallel_config", None), "rank", 0) or 0)
            client = kvferry.Client(name=f"vllm-worker-{rank}", **self._opts)
            self._worker = _Worker(client, compat.canonical_tensors(kv_caches), self.gpu_block_size[0], rank,
                                   f"{os.getpid()}")
        yield GPULoadStoreSpec, KvferryLoadStoreSpec, KvferryHandler(self._worker, store=True)
        yield KvferryLoadStoreSpec, GPULoadStoreSpec, KvferryHandler(self._worker, store=False)
