"""Everything that depends on vLLM's version, in one place (pinned and tested: vllm==0.33.0).

vLLM 0.33.0's offloading interfaces live in ``vllm.v1.kv_offload.base``: an ``OffloadingSpec`` is
built from an ``OffloadingConfig`` and hands out one ``OffloadingManager`` (scheduler side: one
``lookup(key, req_context) -> LookupResult`` per block, ``prepare_store``/``prepare_load`` over
``OffloadKey``s, which are the block hash followed by the 4-byte KV cache group index) and one
``OffloadingWorker`` (worker side: ``submit_store``/``submit_load`` with a ``GPULoadStoreSpec``,
``get_finished() -> [TransferResult]``, ``wait``) built from ``CanonicalKVCaches``.

They are imported from vLLM when it is installed. Without vLLM, stand-ins of the same shape are
defined here, so that the plugin can be imported and its logic tested where vLLM (and torch) are
not installed.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum, auto
from typing import Tuple, Any, List, Optional, Sequence

TESTED_VLLM = "0.33.0"

try:  # pragma: no cover - exercised where vLLM is installed (scripts/test-vllm.sh)
    from vllm.v1.kv_offload.base import (
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
    )

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

    class LoadStoreSpec:  # type: ignore[no-redef]
        """Where a worker finds blocks (vLLM's is a plain base class)."""

    class GPULoadStoreSpec(LoadStoreSpec):  # type: ignore[no-redef]
        def __init__(self, block_ids, group_sizes: Sequence[int], block_indices: Sequence[int]):
            import numpy as np

            self.block_ids = np.array(block_ids, dtype=np.int32)
            assert sum(group_sizes) == len(self.block_ids) and len(block_indices) == len(group_sizes)
            self.group_sizes = group_sizes
            self.block_indices = block_indices

    class LookupResult(Enum):  # type: ignore[no-redef]
        MISS = auto()
        HIT = auto()
        HIT_PENDING = auto()
        RETRY = auto()

    @dataclass
    class PrepareStoreOutput:  # type: ignore[no-redef]
        keys_to_store: list
        store_spec: Any
        evicted_keys: list

    @dataclass
    class RequestOffloadingContext:  # type: ignore[no-redef]
        policy: Any = None

    @dataclass
    class TransferResult:  # type: ignore[no-redef]
        job_id: int
        success: bool
        transfer_size: Optional[int] = None
        transfer_time: Optional[float] = None

    class OffloadingManager(ABC):  # type: ignore[no-redef]
        pass

    class OffloadingWorker(ABC):  # type: ignore[no-redef]
        @abstractmethod
        def submit_store(self, job_id, src_spec, dst_spec) -> bool: ...

        @abstractmethod
        def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool: ...

        @abstractmethod
        def get_finished(self) -> list: ...

        @abstractmethod
        def wait(self, job_ids) -> None: ...

        def shutdown(self) -> None:
            return

    class OffloadingSpec(ABC):  # type: ignore[no-redef]
        """The fields of vLLM's OffloadingSpec that the plugin reads, from an OffloadingConfig-shaped
        object (groups[i].tokens_per_block, cache.blocks_per_chunk, extra_config, ...)."""

        def __init__(self, config):
            self.config = config
            self.extra_config = config.extra_config
            self.replicated_layout = False
            self.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
            self.tokens_per_hash = config.cache.tokens_per_hash
            self.blocks_per_chunk = config.cache.blocks_per_chunk


def request_context() -> Any:
    """A fresh RequestOffloadingContext (what on_new_request returns: the default policy)."""
    return RequestOffloadingContext()


def key_bytes(key: Any) -> bytes:
    """An OffloadKey (block hash + 4-byte group index) as bytes; ints are encoded deterministically
    (tests and older hash types)."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, int):
        return key.to_bytes(32, "little", signed=True)
    hv = getattr(key, "hash_value", None)
    if hv is not None:
        return key_bytes(hv)
    return repr(key).encode()


# The name the plugin used before; kept for callers of kvferry.vllm.compat.
hash_bytes = key_bytes


def transfer_result(job_id: int, success: bool, nbytes: Optional[int] = None,
                    seconds: Optional[float] = None):
    """What OffloadingWorker.get_finished() returns per job."""
    return TransferResult(job_id=job_id, success=success, transfer_size=nbytes, transfer_time=seconds)


def gpu_block_ids(spec) -> List[int]:
    """The GPU block ids of a GPULoadStoreSpec, in order (one KV cache group)."""
    groups: Sequence[int] = getattr(spec, "group_sizes", None) or (len(spec.block_ids),)
    if len([g for g in groups if g]) > 1:
        raise NotImplementedError("kvferry's vLLM plugin handles one KV cache group (hybrid models: not yet)")
    return [int(b) for b in spec.block_ids]


def canonical_tensors(kv_caches) -> List[Any]:
    """vLLM's KV caches as a list of tensors whose first dimension is the block: CanonicalKVCaches
    (.tensors of CanonicalKVCacheTensor: an int8 (num_blocks, page bytes) view, possibly with a
    block stride larger than the page), a dict of layer name -> tensor, or a list."""
    tensors = getattr(kv_caches, "tensors", None)
    if tensors is not None:
        return [getattr(t, "tensor", t) for t in tensors]
    if isinstance(kv_caches, dict):
        return list(kv_caches.values())
    return list(kv_caches)


def config_tokens_per_block(spec) -> int:
    """The GPU block size in tokens (the first offloaded group's)."""
    tpb = getattr(spec, "tokens_per_block", None) or (0,)
    return int(tpb[0])


def config_rank(config) -> int:
    return int(getattr(getattr(config, "parallel", None), "rank", 0) or 0)


def model_fingerprint(config) -> str:
    """The namespace's model part, from an OffloadingConfig: model, KV dtype, block size and
    parallel layout, so that two instances of one model share blocks and different models (or KV
    formats, or shardings) never do."""
    m = getattr(config, "model", None)
    p = getattr(config, "parallel", None)
    groups = getattr(config, "groups", ()) or ()
    bs = groups[0].tokens_per_block if groups else 0
    parts = [
        str(getattr(m, "name", "unknown")),
        str(getattr(m, "dtype", "auto")),
        f"bs{bs}",
        f"tp{getattr(p, 'tp_size', 1)}pp{getattr(p, 'pp_size', 1)}"
        f"cp{getattr(p, 'pcp_size', 1)}x{getattr(p, 'dcp_size', 1)}",
    ]
    text = "|".join(parts)
    if len(text) <= 48:
        return text
    return text[:31] + "~" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def cuda_ipc_handle(tensor) -> Optional[Tuple[bytes, int, int]]:
    """(the 64-byte legacy CUDA IPC handle of a torch CUDA tensor's allocation, the byte offset of
    the tensor's first element in that allocation, the allocation's bytes), or None when torch
    cannot say. A tensor that is a view inside a larger allocation (vLLM's per-layer views of a
    cross-layer buffer, a caching-allocator block) registers at that offset without a copy.
    Uses torch's private UntypedStorage._share_cuda_() (version-sensitive: kept here): it returns
    (device, handle, storage bytes, storage offset in the allocation, ...)."""
    try:
        storage = tensor.untyped_storage()
        info = storage._share_cuda_()
        handle, size, offset = info[1], int(info[2]), int(info[3])
    except Exception:
        return None
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != 64:
        return None
    first = offset + tensor.storage_offset() * tensor.element_size()
    return bytes(handle), first, offset + size
