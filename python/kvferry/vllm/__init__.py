"""kvferry's vLLM plugin: an offloading spec for vLLM's OffloadingConnector (kvferry.vllm.spec).

    kv_connector_extra_config = {"spec_name": "KvferryOffloadingSpec",
                                 "spec_module_path": "kvferry.vllm.spec"}

Tested against vllm==0.33.0; the calls that depend on vLLM's version are in kvferry.vllm.compat.
"""

from .compat import HAVE_VLLM, TESTED_VLLM
from .spec import (
    KvferryLoadStoreSpec,
    KvferryManager,
    KvferryOffloadingSpec,
    KvferryWorker,
    block_key,
    byte_geometry,
)

__all__ = [
    "HAVE_VLLM",
    "TESTED_VLLM",
    "KvferryLoadStoreSpec",
    "KvferryManager",
    "KvferryOffloadingSpec",
    "KvferryWorker",
    "block_key",
    "byte_geometry",
]
