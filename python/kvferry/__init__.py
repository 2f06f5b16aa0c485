"""kvferry: the Python side of the kvferry KV-cache offloading daemon.

    import kvferry
    with kvferry.Client(model="llama-3-8b") as c:
        r = c.create_region("kv", layers=32, blocks=1024, block_size=16, format="mha:bf16:8x128:nhd")
        k0 = r.layer_view(0)                    # zero-copy numpy (CPU backend) / torch (CUDA)
        c.save(r, keys=[b"\\x00" * 16], block_ids=[3])
        c.load(r, keys=[b"\\x00" * 16], block_ids=[7])

Keys are 16 bytes or ints below 2**128; block ids a sequence, numpy array or tensor. Errors are
KvferryError subclasses (``kvferry.errors``) carrying per-block ``statuses``. The library
libkvferry.so is found through KVFERRY_LIBRARY, then next to this package, then the loader path.
"""

from .client import (
    Client,
    EvictResult,
    LookupResult,
    OpResult,
    Region,
    Ticket,
    block_ids_array,
    default_socket,
    key_bytes,
    keys_array,
    version,
)
from .errors import (
    BusyError,
    ChecksumMismatchError,
    ClosedError,
    InvalidArgumentError,
    KvferryError,
    NotFoundError,
    ResourceExhaustedError,
    TimeoutKvError,
    UnavailableError,
    UnsupportedError,
    VersionMismatchError,
    error_class,
    status_name,
)
from ._lib import ABI_VERSION, library_path

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION",
    "BusyError",
    "ChecksumMismatchError",
    "Client",
    "ClosedError",
    "EvictResult",
    "InvalidArgumentError",
    "KvferryError",
    "LookupResult",
    "NotFoundError",
    "OpResult",
    "Region",
    "ResourceExhaustedError",
    "Ticket",
    "TimeoutKvError",
    "UnavailableError",
    "UnsupportedError",
    "VersionMismatchError",
    "block_ids_array",
    "default_socket",
    "error_class",
    "key_bytes",
    "keys_array",
    "library_path",
    "status_name",
    "version",
]
