"""Everything that depends on vLLM's version, in one place (pinned: vllm==0.33.0).

The offloading connector's interfaces (vllm.v1.kv_offload: OffloadingSpec, OffloadingManager,
LoadStoreSpec, PrepareStoreOutput, OffloadingHandler, TransferResult, GPULoadStoreSpec) are
imported from vLLM when it is installed. Without vLLM, stand-ins of the same shape are defined so
that the plugin's logic can be imported and unit-tested on machines without vLLM (and torch).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

TESTED_VLLM = "0.33.0"

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager, PrepareStoreOutput
    from vllm.v1.kv_offload.mediums import GPULoadStoreSpec
    from vllm.v1.kv_offload.spec import OffloadingSpec
    from vllm.v1.kv_offload.worker.worker import OffloadingHandler

    try:
        from vllm.v1.kv_offload.worker.worker import TransferResult
    except ImportError:  # older releases report (job_id, success) tuples
        TransferResult = None
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
    TransferResult = None

    class LoadStoreSpec(ABC):  # type: ignore[no-redef]
        @staticmethod
        @abstractmethod
        def medium() -> str: ...

    class GPULoadStoreSpec(LoadStoreSpec):  # type: ignore[no-redef]
        def __init__(self, block_ids, group_sizes=None, block_indices=None):
            import numpy as np

            self.block_ids = np.asarray(block_ids, dtype=np.int64)
            self.group_sizes = group_sizes if group_sizes is not None else (len(self.block_ids),)
            self.block_indices = block_indices

        @staticmethod
        def medium() -> str:
            return "GPU"

    @dataclass
    class PrepareStoreOutput:  # type: ignore[no-redef]
        block_hashes_to_store: list
        store_spec: Any
        block_hashes_evicted: list

    class OffloadingManager(ABC):  # type: ignore[no-redef]
        pass

    class OffloadingHandler(ABC):  # type: ignore[no-redef]
        pass

    class OffloadingSpec(ABC):  # type: ignore[no-redef]
        """The fields of vLLM's OffloadingSpec the plugin reads, from a plain config object."""

        def __init__(self, vllm_config, kv_cache_config):
            self.vllm_config = vllm_config
            self.kv_cache_config = kv_cache_config
            self.extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
            self.hash_block_size = vllm_config.cache_config.block_size
            self.gpu_block_size = tuple(
                g.kv_cache_spec.block_size for g in getattr(kv_cache_config, "kv_cache_groups", [])
            ) or (self.hash_block_size,)
            self.offloaded_block_size = int(self.extra_config.get("block_size", self.gpu_block_size[0]))
            self.block_size_factors = tuple(self.offloaded_block_size // b for b in self.gpu_block_size)


def hash_bytes(block_hash: Any) -> bytes:
    """vLLM's block hash as bytes: bytes in current releases; ints and the older BlockHash tuples
    (hash_value, token_ids, extra_keys) are encoded deterministically."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash)
    if isinstance(block_hash, int):
        return block_hash.to_bytes(32, "little", signed=True)
    hv = getattr(block_hash, "hash_value", None)
    if hv is not None:
        return hash_bytes(hv)
    return repr(block_hash).encode()


def transfer_result(job_id: int, success: bool, nbytes: Optional[int] = None, seconds: Optional[float] = None,
                    transfer_type=None):
    """What OffloadingHandler.get_finished() returns per job in this vLLM version."""
    if TransferResult is not None:
        return TransferResult(job_id=job_id, success=success, transfer_size=nbytes, transfer_time=seconds,
                              transfer_type=transfer_type)
    return (job_id, success)


def gpu_block_ids(spec) -> List[int]:
    """The GPU block ids of a GPULoadStoreSpec (one KV cache group)."""
    groups: Sequence[int] = getattr(spec, "group_sizes", None) or (len(spec.block_ids),)
    if len(groups) > 1:
        raise NotImplementedError("kvferry's vLLM plugin handles one KV cache group (hybrid models: not yet)")
    return [int(b) for b in spec.block_ids]


def canonical_tensors(kv_caches) -> List[Any]:
    """vLLM's KV caches as a list of tensors whose first dimension is the block: CanonicalKVCaches
    (current), a dict of layer name -> tensor, or a list."""
    tensors = getattr(kv_caches, "tensors", None)
    if tensors is not None:
        return [getattr(t, "tensor", t) for t in tensors]
    if isinstance(kv_caches, dict):
        return list(kv_caches.values())
    return list(kv_caches)


def model_fingerprint(vllm_config) -> str:
    """The namespace's model part: model, revision, KV dtype and block size, so that two instances
    of one model share blocks and different models (or KV formats) never do."""
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    parts = [
        str(getattr(mc, "model", "unknown")),
        str(getattr(mc, "revision", None) or "main"),
        str(getattr(cc, "cache_dtype", "auto")),
        f"bs{getattr(cc, 'block_size', 0)}",
    ]
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None:
        parts.append(f"tp{getattr(pc, 'tensor_parallel_size', 1)}pp{getattr(pc, 'pipeline_parallel_size', 1)}")
    text = "|".join(parts)
    if len(text) <= 48:
        return text
    return text[:31] + "~" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def cuda_ipc_handle(tensor) -> Optional[bytes]:
    """The 64-byte legacy CUDA IPC handle of a torch CUDA tensor's allocation, or None when the
    tensor does not start its allocation (the daemon maps whole allocations) or torch cannot say.
    Uses torch's private UntypedStorage._share_cuda_() (version-sensitive: kept here)."""
    try:
        storage = tensor.untyped_storage()
        info = storage._share_cuda_()
        handle, offset = info[1], info[3]
    except Exception:
        return None
    if offset != 0 or tensor.storage_offset() != 0 or not isinstance(handle, (bytes, bytearray)) or len(handle) != 64:
        return None
    return bytes(handle)
