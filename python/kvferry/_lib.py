"""ctypes declarations of libkvferry.so (connector/include/kvferry/connector/kvferry.h).

The library is found through ``KVFERRY_LIBRARY`` (a path), then next to this package, then the
dynamic loader's search path. Nothing here is compiled: a plain ``pip install`` needs no compiler.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import threading

#: The C ABI version this package was written against (KVFERRY_ABI_VERSION of kvferry.h).
ABI_VERSION = 4

c_int = ctypes.c_int
c_int16 = ctypes.c_int16
c_int32 = ctypes.c_int32
c_int64 = ctypes.c_int64
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_char_p = ctypes.c_char_p
c_void_p = ctypes.c_void_p
P = ctypes.POINTER


class Key(ctypes.Structure):
    _fields_ = [("hi", c_uint64), ("lo", c_uint64)]


class Cqe(ctypes.Structure):
    _fields_ = [
        ("id", c_uint64),
        ("status", c_int16),
        ("op", ctypes.c_uint16),
        ("count", c_uint32),
        ("arena_offset", c_uint32),
        ("done", c_uint32),
        ("result", c_uint64 * 5),
    ]


class View(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int32),
        ("elem_bytes", c_int32),
        ("rank", c_int32),
        ("on_device", c_int32),
        ("sizes", c_int64 * 4),
        ("strides", c_int64 * 4),
        ("offset", c_int64),
    ]


class LsEntry(ctypes.Structure):
    _fields_ = [
        ("key", Key),
        ("bytes", c_uint64),
        ("pins", c_uint32),
        ("reserved", c_uint32),
        ("ns", ctypes.c_char * 96),
        ("format", ctypes.c_char * 32),
        ("tier", ctypes.c_char * 8),
    ]


class RegionInfo(ctypes.Structure):
    _fields_ = [
        ("id", c_uint32),
        ("name", ctypes.c_char * 64),
        ("layers", c_int64),
        ("blocks", c_int64),
        ("block_size", c_int64),
        ("format", ctypes.c_char * 64),
        ("layout", c_int32),
        ("bytes", c_uint64),
        ("backend", c_int32),
        ("device", c_int32),
    ]


CONNECT_F_ABI_VERSION = 1 << 0
CONNECT_F_SOCKET = 1 << 1
CONNECT_F_CLIENT_NAME = 1 << 2
CONNECT_F_NAMESPACE = 1 << 3
CONNECT_F_TIMEOUT_MS = 1 << 4
CONNECT_F_SPIN_US = 1 << 5


class ConnectParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("abi_version", c_uint32),
        ("timeout_ms", c_int32),
        ("socket", c_char_p),
        ("client_name", c_char_p),
        ("model", c_char_p),
        ("tenant", c_char_p),
        ("spin_us", c_int64),
    ]


REGION_F_SPEC = 1 << 0
REGION_F_BUFFER = 1 << 1


class RegionParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("name", c_char_p),
        ("layers", c_int64),
        ("blocks", c_int64),
        ("block_size", c_int64),
        ("format", c_char_p),
        ("layout", c_int32),
        ("backend", c_int32),
        ("fd", c_int32),
        ("device", c_int32),
        ("ipc_handle", c_void_p),
        ("base", c_void_p),
        ("alloc_bytes", c_uint64),
        ("offset", c_uint64),
    ]


REGION_F_OFFSET = 1 << 2
REGION_DESC_F_BASIC = 1 << 0
REGION_DESC_F_MAPPING = 1 << 1


class RegionDesc(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("id", c_uint32),
        ("layout", c_int32),
        ("name", ctypes.c_char * 64),
        ("format", ctypes.c_char * 64),
        ("layers", c_int64),
        ("blocks", c_int64),
        ("block_size", c_int64),
        ("bytes", c_uint64),
        ("backend", c_int32),
        ("device", c_int32),
        ("mapped", c_int32),
        ("reserved", c_int32),
        ("base", c_void_p),
        ("block_bytes", c_uint64),
    ]


STATS_F_STORE = 1 << 0
STATS_FIELDS = (
    "entries writing pinned used_bytes capacity_bytes evictions evicted_bytes lookups hits misses "
    "blocks_saved bytes_saved blocks_loaded bytes_loaded checksum_failures clients pool_pinned"
).split()


class StoreStats(ctypes.Structure):
    _fields_ = [("field_mask", c_uint64)] + [(f, c_uint64) for f in STATS_FIELDS]


TIER_F_BASIC = 1 << 0
TIER_F_STORAGE = 1 << 1
TIER_F_PEERS = 1 << 2
TIER_F_ALL = 0x7
TIER_STORAGE_FIELDS = (
    "capacity_bytes used_bytes blocks pinned evictions io_errors checksum_failures bytes_written bytes_read"
).split()
TIER_PEER_FIELDS = "peers_live peers_lost blocks_out bytes_out blocks_in bytes_in errors".split()


class TierStats(ctypes.Structure):
    _fields_ = (
        [
            ("field_mask", c_uint64),
            ("tier", ctypes.c_char * 8),
            ("healthy", c_int32),
            ("reserved", c_int32),
            ("reason", ctypes.c_char * 64),
        ]
        + [(f, c_uint64) for f in TIER_STORAGE_FIELDS]
        + [("member", ctypes.c_char * 64)]
        + [(f, c_uint64) for f in TIER_PEER_FIELDS]
    )


EVICT_ALL = 1
EVICT_ALL_NS = 2

_PROTOS = {
    "kvferry_last_error": (c_char_p, []),
    "kvferry_status_name": (c_char_p, [c_int]),
    "kvferry_version": (c_char_p, []),
    "kvferry_abi_version": (c_uint32, []),
    "kvferry_protocol_version": (c_uint32, []),
    "kvferry_connect_with": (c_int, [P(ConnectParams), P(c_void_p)]),
    "kvferry_close": (None, [c_void_p]),
    "kvferry_client_id": (c_int, [c_void_p, P(c_uint32)]),
    "kvferry_connection_status": (c_int, [c_void_p]),
    "kvferry_region_count": (c_int, [c_void_p, P(c_uint32)]),
    "kvferry_get_region_info": (c_int, [c_void_p, c_uint32, P(RegionInfo)]),
    "kvferry_find_region": (c_int, [c_void_p, c_char_p, P(c_uint32)]),
    "kvferry_map_region": (c_int, [c_void_p, c_uint32, P(c_void_p)]),
    "kvferry_create_region_with": (c_int, [c_void_p, P(RegionParams), P(c_uint32)]),
    "kvferry_register_region_with": (c_int, [c_void_p, P(RegionParams), P(c_uint32)]),
    "kvferry_describe_region": (c_int, [c_void_p, c_uint32, P(RegionDesc)]),
    "kvferry_layer_view": (c_int, [c_void_p, c_uint32, c_int64, P(View)]),
    "kvferry_kv_view": (c_int, [c_void_p, c_uint32, c_int64, c_int32, P(View)]),
    "kvferry_ping": (c_int, [c_void_p, c_uint64, c_uint64]),
    "kvferry_wait": (c_int, [c_void_p, P(Cqe), c_uint32, c_int64, P(c_uint32)]),
    "kvferry_submit_lookup": (c_int, [c_void_p, c_uint32, c_void_p, c_uint32, P(c_uint64)]),
    "kvferry_submit_save": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint32, P(c_uint64)]),
    "kvferry_submit_load": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint32, P(c_uint64)]),
    "kvferry_wait_op": (c_int, [c_void_p, c_uint64, c_int64, c_void_p, c_uint32, P(c_uint32), P(c_uint64)]),
    "kvferry_lookup": (c_int, [c_void_p, c_uint32, c_void_p, c_uint32, c_void_p, P(c_uint32)]),
    "kvferry_save": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint32, c_void_p, P(c_uint32)]),
    "kvferry_load": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint32, c_void_p, P(c_uint32)]),
    "kvferry_pin": (c_int, [c_void_p, c_uint32, c_void_p, c_uint32, c_void_p, P(c_uint32)]),
    "kvferry_unpin": (c_int, [c_void_p, c_uint32, c_void_p, c_uint32, c_void_p, P(c_uint32)]),
    "kvferry_evict": (c_int, [c_void_p, c_uint32, c_void_p, c_uint32, c_uint64, c_void_p, P(c_uint64)]),
    "kvferry_get_stats": (c_int, [c_void_p, P(StoreStats)]),
    "kvferry_ls": (c_int, [c_void_p, c_uint32, P(LsEntry), c_uint32, P(c_uint32)]),
    "kvferry_debug_read": (c_int, [c_void_p, c_uint32, c_uint64, c_void_p, c_uint32]),
    "kvferry_daemon_status_json": (c_int, [c_void_p, c_char_p, c_uint32, P(c_uint32)]),
    "kvferry_send": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint32, c_char_p, c_void_p, P(c_uint32)]),
    "kvferry_send_into": (
        c_int,
        [c_void_p, c_uint32, c_void_p, c_void_p, c_uint32, c_char_p, c_uint32, c_void_p, c_void_p, P(c_uint32)],
    ),
    "kvferry_lookup_wait": (c_int, [c_void_p, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, P(c_uint32)]),
    "kvferry_peers_json": (c_int, [c_void_p, c_char_p, c_uint32, P(c_uint32)]),
    "kvferry_get_tier_stats": (c_int, [c_void_p, P(TierStats), c_uint32, P(c_uint32)]),
    "kvferry_submit_load_mapped": (
        c_int,
        [c_void_p, c_uint32, c_void_p, c_void_p, c_void_p, c_uint32, P(c_uint64)],
    ),
}

_lock = threading.Lock()
_lib = None
_path = None


def _candidates():
    env = os.environ.get("KVFERRY_LIBRARY")
    if env:
        yield env, "KVFERRY_LIBRARY"
        return
    here = pathlib.Path(__file__).resolve().parent
    for name in ("libkvferry.so", "libkvferry.so.0"):
        p = here / name
        if p.exists():
            yield str(p), "the package folder"
    found = ctypes.util.find_library("kvferry")
    for name in ([found] if found else []) + ["libkvferry.so", "libkvferry.so.0"]:
        yield name, "the loader path"


def lib():
    """The loaded library (loaded once, on first use)."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for cand, where in _candidates():
            try:
                handle = ctypes.CDLL(cand)
            except OSError as e:
                tried.append(f"{cand} ({where}): {e}")
                continue
            for name, (res, args) in _PROTOS.items():
                try:
                    fn = getattr(handle, name)
                except AttributeError:
                    raise ImportError(
                        f"{cand} has no {name}: it is older than this package (abi {ABI_VERSION}); "
                        "build libkvferry from the same source tree or point KVFERRY_LIBRARY at a newer one"
                    ) from None
                fn.restype = res
                fn.argtypes = args
            abi = handle.kvferry_abi_version()
            if abi < ABI_VERSION:
                raise ImportError(f"{cand} is abi {abi}, this package needs abi {ABI_VERSION} or newer")
            _lib, _path = handle, cand
            return _lib
        raise ImportError(
            "cannot load libkvferry.so; set KVFERRY_LIBRARY to its path (e.g. build/lib/libkvferry.so). Tried: "
            + "; ".join(tried)
        )


def library_path() -> str:
    """Where the library was loaded from."""
    lib()
    return _path
