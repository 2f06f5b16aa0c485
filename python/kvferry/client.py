"""Client, Region and Ticket: kvferry for Python engines, over the C ABI (libkvferry.so).

Threads: one Client may be used from several threads (the C library serializes what needs it and
lets one thread submit while another waits); ctypes releases the GIL for every call, so a wait
does not hold up other Python threads.

Lifetimes: arrays and tensors returned by Region.layer_view() alias the region's memory without a
copy. They keep the connection (and so the mapping) alive: Client.close() disconnects as soon as
no such array and no Ticket of this client is alive any more.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence, Union

import numpy as np

from . import _lib as L
from .errors import (
    NOT_FOUND,
    TIMEOUT,
    ClosedError,
    InvalidArgumentError,
    KvferryError,
    make_error,
    status_name,
)

KeyLike = Union[bytes, bytearray, int]

# DType values of layouts/dtype.h -> (numpy dtype, torch dtype name, typestr for array interfaces)
_DTYPES = {
    0: (np.uint8, "uint8", "|u1"),
    1: (np.uint16, "bfloat16", "<u2"),  # numpy has no bf16: the bits, as uint16
    2: (np.float16, "float16", "<f2"),
    3: (np.float32, "float32", "<f4"),
    4: (np.uint8, "float8_e4m3fn", "|u1"),  # e4m3 bits, as uint8
    5: (np.int32, "int32", "<i4"),
    6: (np.int64, "int64", "<i8"),
}
_BACKENDS = {0: "memfd", 1: "cuda_vmm", 2: "cuda_ipc"}
_WAIT_SLICE_US = 200_000  # long waits are cut in slices so that Ctrl-C works


def _check(rc: int, what: str = "", **kw) -> None:
    if rc != 0:
        msg = L.lib().kvferry_last_error().decode(errors="replace")
        prefix = status_name(rc) + ": "
        if msg.startswith(prefix):  # the name is printed once, by KvferryError.__str__
            msg = msg[len(prefix) :]
        raise make_error(rc, f"{what}: {msg}" if what else msg, **kw)


def keys_array(keys) -> np.ndarray:
    """Keys as an (n, 2) uint64 array of (hi, lo) (the C ABI's kvferry_key layout).

    A key is 16 bytes (big-endian: the first 8 are ``hi``, as `kvferry ls` prints them) or an int
    in [0, 2**128). ``keys`` is one key, a sequence of keys, or an (n, 2) uint64 array.
    """
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64 and keys.ndim == 2 and keys.shape[1] == 2:
            return np.ascontiguousarray(keys)
        if keys.dtype.kind in "iu" and keys.ndim == 1:
            keys = [int(k) for k in keys]
        else:
            raise InvalidArgumentError(f"keys array must be (n, 2) uint64 (hi, lo), got {keys.dtype} {keys.shape}")
    elif isinstance(keys, (bytes, bytearray, memoryview, int)) and not isinstance(keys, bool):
        keys = [keys]
    elif hasattr(keys, "tolist") and not isinstance(keys, (list, tuple)):  # a tensor of int keys
        keys = keys.tolist()
    if keys and all(type(k) is int for k in keys):  # the common case, without a Python step per element
        if min(keys) < 0 or max(keys) >> 128:
            bad = next(i for i, k in enumerate(keys) if k < 0 or k >> 128)
            raise InvalidArgumentError(f"key {bad} = {keys[bad]} is outside [0, 2**128)")
        out = np.empty((len(keys), 2), dtype=np.uint64)
        out[:, 0] = [k >> 64 for k in keys]
        out[:, 1] = [k & 0xFFFFFFFFFFFFFFFF for k in keys]
        return out
    out = np.empty((len(keys), 2), dtype=np.uint64)
    for i, k in enumerate(keys):
        if isinstance(k, (bytes, bytearray, memoryview)):
            b = bytes(k)
            if len(b) != 16:
                raise InvalidArgumentError(f"key {i} has {len(b)} bytes, a key has 16")
            out[i, 0] = int.from_bytes(b[:8], "big")
            out[i, 1] = int.from_bytes(b[8:], "big")
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            k = int(k)
            if k < 0 or k >> 128:
                raise InvalidArgumentError(f"key {i} = {k} is outside [0, 2**128)")
            out[i, 0] = k >> 64
            out[i, 1] = k & 0xFFFFFFFFFFFFFFFF
        else:
            raise InvalidArgumentError(f"key {i} is a {type(k).__name__}: a key is 16 bytes or an int")
    return out


def key_bytes(hi: int, lo: int) -> bytes:
    return int(hi).to_bytes(8, "big") + int(lo).to_bytes(8, "big")


def block_ids_array(block_ids) -> np.ndarray:
    """Block ids as a contiguous int64 array (from a sequence, a numpy array or a torch tensor)."""
    if hasattr(block_ids, "detach") and hasattr(block_ids, "cpu"):  # torch.Tensor
        block_ids = block_ids.detach().cpu().numpy()
    elif isinstance(block_ids, (int, np.integer)):
        block_ids = [block_ids]
    a = np.asarray(block_ids)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise InvalidArgumentError(f"block ids must be a 1-d sequence of integers, got {a.dtype} {a.shape}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data if a.size else 0


@dataclass
class OpResult:
    """The outcome of a data op: one status per block (0 = ok) and how many blocks succeeded."""

    op: str
    statuses: np.ndarray
    done: int
    code: int = 0  # 0, or the first failing block's code

    @property
    def ok(self) -> bool:
        return self.code == 0

    def failed_blocks(self) -> np.ndarray:
        return np.nonzero(self.statuses)[0]

    def raise_for_status(self) -> "OpResult":
        if self.code != 0:
            n = len(self.statuses)
            raise make_error(
                self.code,
                f"{self.op}: {n - self.done} of {n} blocks failed (first: {status_name(self.code)}; "
                "see .statuses)",
                statuses=self.statuses,
                done=self.done,
                result=self,
            )
        return self


@dataclass
class LookupResult(OpResult):
    """lookup: ``prefix`` = how many leading keys are all stored; ``hits[i]`` whether key i is."""

    prefix: int = 0

    @property
    def hits(self) -> np.ndarray:
        return self.statuses == 0


@dataclass
class EvictResult(OpResult):
    evicted: int = 0


class _Conn:
    """Owns one kvferry_client*. Closed when the last reference goes: the Client's, a view's or a
    Ticket's (views alias memory the handle maps)."""

    def __init__(self, handle: int):
        self.handle = handle
        self._lib = L.lib()

    def __del__(self):
        h, self.handle = self.handle, None
        if h:
            try:
                self._lib.kvferry_close(h)
            except Exception:  # interpreter shutdown
                pass


class _HostArray:
    """A numpy-visible window on mapped host memory; keeps the connection alive."""

    def __init__(self, conn: _Conn, ptr: int, shape, strides_bytes, typestr: str):
        self._conn = conn
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(shape),
            "strides": tuple(strides_bytes),
            "typestr": typestr,
            "data": (ptr, False),
        }


class _CudaArray:
    """A __cuda_array_interface__ window on mapped GPU memory; keeps the connection alive."""

    def __init__(self, conn: _Conn, ptr: int, shape, strides_bytes, typestr: str, device: int):
        self._conn = conn
        self.device = device
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": tuple(shape),
            "strides": tuple(strides_bytes),
            "typestr": typestr,
            "data": (ptr, False),
            "stream": None,  # the daemon's copies are complete when an op's completion arrives
        }


def _torch():
    try:
        import torch  # noqa: F401

        return torch
    except ImportError:
        return None


class Region:
    """A region of the daemon, mapped into this process.

    ``layer_view(l)`` is layer l's per-layer view without a copy: a numpy array on the CPU backend
    (bf16 as uint16 bits, fp8 as uint8 bits), a torch tensor on a CUDA backend when torch is
    importable (bf16 and fp8 in their torch dtypes), else an object with __cuda_array_interface__.
    """

    def __init__(self, client: "Client", region_id: int):
        self._client = client
        self.id = int(region_id)
        d = L.RegionDesc()
        d.field_mask = L.REGION_DESC_F_BASIC | L.REGION_DESC_F_MAPPING
        _check(L.lib().kvferry_describe_region(client._handle(), self.id, ctypes.byref(d)), "describe_region")
        self.name = d.name.decode()
        self.format = d.format.decode()
        self.layers, self.blocks, self.block_size = d.layers, d.blocks, d.block_size
        self.layout = "block_major" if d.layout == 0 else "layer_major"
        self.bytes = d.bytes
        self.backend = _BACKENDS.get(d.backend, str(d.backend))
        self.device = d.device
        self.block_bytes = d.block_bytes
        self.base = d.base or 0

    @property
    def on_device(self) -> bool:
        return self.backend != "memfd"

    def __repr__(self) -> str:
        return (
            f"Region(id={self.id}, name={self.name!r}, {self.layers} layers x {self.blocks} blocks x "
            f"{self.block_size} tokens of {self.format}, {self.layout}, {self.backend})"
        )

    def _view(self, layer: int, plane: Optional[int], as_: str):
        conn = self._client._conn_or_raise()
        v = L.View()
        if plane is None:
            _check(L.lib().kvferry_layer_view(conn.handle, self.id, int(layer), ctypes.byref(v)), f"layer_view({layer})")
        else:
            _check(
                L.lib().kvferry_kv_view(conn.handle, self.id, int(layer), int(plane), ctypes.byref(v)),
                f"kv_view({layer}, {plane})",
            )
        np_dtype, torch_name, typestr = _DTYPES[v.dtype]
        shape = [v.sizes[i] for i in range(v.rank)]
        strides = [v.strides[i] * v.elem_bytes for i in range(v.rank)]
        if v.on_device:
            cai = _CudaArray(conn, v.data, shape, strides, typestr, self.device)
            if as_ == "numpy":
                raise InvalidArgumentError("a CUDA region's view cannot be a numpy array (it is GPU memory)")
            torch = _torch()
            if torch is None or as_ == "interface":
                return cai
            t = torch.as_tensor(cai, device=f"cuda:{self.device}")
            want = getattr(torch, torch_name)
            t = t.view(want) if t.dtype != want else t
            t._kvferry_keepalive = cai  # the tensor shares memory the connection maps
            return t
        arr = np.asarray(_HostArray(conn, v.data, shape, strides, typestr))
        if as_ == "torch":
            torch = _torch()
            if torch is None:
                raise ImportError("layer_view(as_='torch') needs torch")
            t = torch.from_numpy(arr)
            want = getattr(torch, torch_name)
            return t.view(want) if t.dtype != want else t
        return arr

    def layer_view(self, layer: int, as_: str = "auto"):
        """Layer ``layer``'s view (for MHA formats: the K plane). ``as_``: "auto" (numpy on the CPU
        backend, torch on CUDA), "numpy", "torch", "interface" (the raw array-interface object)."""
        return self._view(layer, None, as_)

    def kv_view(self, layer: int, v_plane: bool, as_: str = "auto"):
        """MHA: layer ``layer``'s K (v_plane False) or V plane."""
        return self._view(layer, 1 if v_plane else 0, as_)

    def block_bytes_view(self, block: int) -> np.ndarray:
        """Block ``block``'s bytes, all layers (block_major, CPU backend): a uint8 array aliasing it."""
        if self.layout != "block_major":
            raise InvalidArgumentError("block_bytes_view needs a block_major region")
        if self.on_device:
            raise InvalidArgumentError("block_bytes_view is for host regions; use layer_view on CUDA")
        if not 0 <= block < self.blocks:
            raise InvalidArgumentError(f"block {block} is outside [0, {self.blocks})")
        conn = self._client._conn_or_raise()
        return np.asarray(
            _HostArray(conn, self.base + block * self.block_bytes, (self.block_bytes,), (1,), "|u1")
        )

    def debug_read(self, offset: int, nbytes: int) -> bytes:
        """Region bytes read through the daemon's own mapping (tests, debugging)."""
        buf = ctypes.create_string_buffer(nbytes)
        _check(L.lib().kvferry_debug_read(self._client._handle(), self.id, offset, buf, nbytes), "debug_read")
        return buf.raw

    # Data ops on this region.
    def lookup(self, keys, **kw):
        return self._client.lookup(self, keys, **kw)

    def save(self, keys, block_ids, **kw):
        return self._client.save(self, keys, block_ids, **kw)

    def load(self, keys, block_ids, **kw):
        return self._client.load(self, keys, block_ids, **kw)


class Ticket:
    """A data op in flight. ``wait()`` blocks (the GIL is released); ``await ticket`` waits in a
    worker thread so that an asyncio loop keeps running; ``done()`` checks without blocking."""

    def __init__(self, client: "Client", conn: _Conn, req: int, op: str, n: int, check: bool):
        self._client = client
        self._conn = conn
        self.req = req
        self.op = op
        self.n = n
        self._check = check
        self._lock = threading.Lock()
        self._result: Optional[OpResult] = None
        self._error: Optional[BaseException] = None

    def _try(self, timeout_us: int) -> bool:
        # caller holds _lock
        if self._result is not None or self._error is not None:
            return True
        st = np.zeros(self.n, dtype=np.int16)
        done = L.c_uint32(0)
        res = (L.c_uint64 * 5)()
        rc = L.lib().kvferry_wait_op(self._conn.handle, self.req, timeout_us, _ptr(st), self.n, ctypes.byref(done), res)
        if rc == TIMEOUT:
            return False
        if rc != 0 and done.value == 0 and not st.any():  # the request itself failed
            msg = L.lib().kvferry_last_error().decode(errors="replace")
            self._error = make_error(rc, f"{self.op}: {msg}")
            self._conn = None
            return True
        if self.op == "lookup":
            r = LookupResult(self.op, st, done.value, 0, prefix=int(res[0]))
        else:
            r = OpResult(self.op, st, done.value, rc)
        self._result = r
        self._conn = None  # the op is over: the ticket no longer holds the connection
        return True

    def done(self) -> bool:
        with self._lock:
            return self._try(0)

    def wait(self, timeout: Optional[float] = None):
        """The op's result (OpResult / LookupResult). Raises the KvferryError subclass of the failure
        (with per-block ``statuses``) unless the op was submitted with check=False; a lookup's
        misses are answers, not failures. ``timeout`` in seconds (None: until the daemon answers or
        goes away); TimeoutKvError leaves the op in flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if deadline is None:
                    slice_us = _WAIT_SLICE_US
                else:
                    slice_us = max(0, min(_WAIT_SLICE_US, int((deadline - time.monotonic()) * 1e6)))
                if self._try(slice_us):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise make_error(TIMEOUT, f"{self.op}: not complete within {timeout} s (still in flight)")
        if self._error is not None:
            raise self._error
        if self._check:
            self._result.raise_for_status()
        return self._result

    def __await__(self):
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.wait).__await__()

    def __repr__(self) -> str:
        return f"Ticket({self.op}, {self.n} blocks, req={self.req:#x})"


def default_socket() -> str:
    return os.environ.get("KVFERRY_SOCKET") or "/run/kvferry/kvferry.sock"


class Client:
    """A connection to kvferryd.

    ``Client(socket=None, name="python", model=None, tenant=None)``: socket None = $KVFERRY_SOCKET,
    else /run/kvferry/kvferry.sock. ``model``/``tenant`` pick the block namespace (blocks are
    shared between clients of one model, tenant and format family, never across). Use as a
    context manager, or call close().
    """

    def __init__(
        self,
        socket: Optional[str] = None,
        name: str = "python",
        model: Optional[str] = None,
        tenant: Optional[str] = None,
        timeout_ms: int = 5000,
        spin_us: Optional[int] = None,
    ):
        lib = L.lib()
        p = L.ConnectParams()
        p.field_mask = L.CONNECT_F_ABI_VERSION | L.CONNECT_F_CLIENT_NAME | L.CONNECT_F_TIMEOUT_MS
        p.abi_version = L.ABI_VERSION
        p.client_name = name.encode()
        p.timeout_ms = int(timeout_ms)
        self.socket = socket or default_socket()
        p.field_mask |= L.CONNECT_F_SOCKET
        p.socket = self.socket.encode()
        if model or tenant:
            p.field_mask |= L.CONNECT_F_NAMESPACE
            p.model = (model or "").encode()
            p.tenant = (tenant or "").encode()
        if spin_us is not None:
            p.field_mask |= L.CONNECT_F_SPIN_US
            p.spin_us = int(spin_us)
        h = ctypes.c_void_p()
        _check(lib.kvferry_connect_with(ctypes.byref(p), ctypes.byref(h)), f"connect to {self.socket}")
        self._conn: Optional[_Conn] = _Conn(h.value)
        self._regions = {}
        cid = L.c_uint32()
        _check(lib.kvferry_client_id(h.value, ctypes.byref(cid)))
        self.id = cid.value

    # ---- lifetime ----
    def close(self) -> None:
        """Ends this client. The connection closes at once unless views or Tickets of it are still
        alive; then it closes when the last of them goes (their memory stays valid till then)."""
        self._conn = None
        self._regions = {}

    @property
    def closed(self) -> bool:
        return self._conn is None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _conn_or_raise(self) -> _Conn:
        c = self._conn
        if c is None:
            raise ClosedError("the client is closed")
        return c

    def _handle(self) -> int:
        return self._conn_or_raise().handle

    def connected(self) -> bool:
        """False once the daemon closed the connection (it died or stopped)."""
        c = self._conn
        return c is not None and L.lib().kvferry_connection_status(c.handle) == 0

    # ---- regions ----
    def regions(self) -> List[Region]:
        """The regions this client knows (offered at connect, created, mapped), mapped on demand."""
        lib = L.lib()
        n = L.c_uint32()
        _check(lib.kvferry_region_count(self._handle(), ctypes.byref(n)))
        out = []
        fn = lib.kvferry_get_region_info
        for i in range(n.value):
            info = L.RegionInfo()
            _check(fn(self._handle(), i, ctypes.byref(info)), "region info")
            out.append(self.region(info.id))
        return out

    def region(self, name_or_id: Union[str, int]) -> Region:
        """A region by name or id, mapped into this process."""
        lib = L.lib()
        if isinstance(name_or_id, str):
            rid = L.c_uint32()
            _check(lib.kvferry_find_region(self._handle(), name_or_id.encode(), ctypes.byref(rid)), name_or_id)
            rid = rid.value
        else:
            rid = int(name_or_id)
        if rid in self._regions:
            return self._regions[rid]
        base = ctypes.c_void_p()
        _check(lib.kvferry_map_region(self._handle(), rid, ctypes.byref(base)), f"map region {rid}")
        r = Region(self, rid)
        self._regions[rid] = r
        return r

    def create_region(
        self, name: str, layers: int, blocks: int, block_size: int, format: str, layout: str = "block_major"
    ) -> Region:
        """Creates (or reuses one of that name and spec) a daemon-owned region and maps it."""
        if layout not in ("block_major", "layer_major"):
            raise InvalidArgumentError(f"layout must be block_major or layer_major, not {layout!r}")
        p = L.RegionParams()
        p.field_mask = L.REGION_F_SPEC
        p.name = name.encode()
        p.layers, p.blocks, p.block_size = int(layers), int(blocks), int(block_size)
        p.format = format.encode()
        p.layout = 0 if layout == "block_major" else 1
        rid = L.c_uint32()
        _check(L.lib().kvferry_create_region_with(self._handle(), ctypes.byref(p), ctypes.byref(rid)), f"create {name}")
        self._regions.pop(rid.value, None)
        return self.region(rid.value)

    def register_region(
        self,
        name: str,
        layers: int,
        blocks: int,
        block_size: int,
        format: str,
        *,
        base: int,
        alloc_bytes: int,
        fd: int = -1,
        backend: str = "memfd",
        device: int = -1,
        ipc_handle: Optional[bytes] = None,
        layout: str = "block_major",
        offset: int = 0,
    ) -> Region:
        """Registers a buffer this process allocated (memfd sealed with F_SEAL_SHRINK, a cuMem
        POSIX fd, or a 64-byte legacy CUDA IPC handle); this process keeps owning it. ``base`` is
        where the buffer is mapped and ``alloc_bytes`` its size; with ``offset`` the region starts
        that many bytes into it (a KV tensor inside a larger allocation, registered without a
        copy; only this client maps it)."""
        backends = {"memfd": 0, "cuda_vmm": 1, "cuda_ipc": 2}
        if backend not in backends:
            raise InvalidArgumentError(f"backend must be one of {sorted(backends)}, not {backend!r}")
        p = L.RegionParams()
        p.field_mask = L.REGION_F_SPEC | L.REGION_F_BUFFER
        p.name = name.encode()
        p.layers, p.blocks, p.block_size = int(layers), int(blocks), int(block_size)
        p.format = format.encode()
        p.layout = 0 if layout == "block_major" else 1
        p.backend = backends[backend]
        p.fd = int(fd)
        p.device = int(device)
        keep = None
        if ipc_handle is not None:
            if len(ipc_handle) != 64:
                raise InvalidArgumentError("a CUDA IPC handle has 64 bytes")
            keep = ctypes.create_string_buffer(bytes(ipc_handle), 64)
            p.ipc_handle = ctypes.addressof(keep)
        p.base = int(base)
        p.alloc_bytes = int(alloc_bytes)
        if offset:
            p.field_mask |= L.REGION_F_OFFSET
            p.offset = int(offset)
        rid = L.c_uint32()
        _check(
            L.lib().kvferry_register_region_with(self._handle(), ctypes.byref(p), ctypes.byref(rid)), f"register {name}"
        )
        self._regions.pop(rid.value, None)
        return self.region(rid.value)

    # ---- data ops ----
    @staticmethod
    def _rid(region) -> int:
        return region.id if isinstance(region, Region) else int(region)

    def _submit(self, op: str, region, keys, block_ids, check: bool) -> Ticket:
        conn = self._conn_or_raise()
        k = keys_array(keys)
        n = len(k)
        req = L.c_uint64()
        lib = L.lib()
        rid = self._rid(region)
        if op == "lookup":
            rc = lib.kvferry_submit_lookup(conn.handle, rid, _ptr(k), n, ctypes.byref(req))
        else:
            b = block_ids_array(block_ids)
            if len(b) != n:
                raise InvalidArgumentError(f"{op}: {n} keys but {len(b)} block ids")
            fn = lib.kvferry_submit_save if op == "save" else lib.kvferry_submit_load
            rc = fn(conn.handle, rid, _ptr(k), _ptr(b), n, ctypes.byref(req))
        _check(rc, op)
        return Ticket(self, conn, req.value, op, n, check)

    def load_mapped_async(self, region, keys, block_ids, parts, check: bool = True) -> Ticket:
        """Queues a load across geometries: entry i puts part ``parts[i]`` of the stored block
        ``keys[i]`` into region block ``block_ids[i]`` (see ``load_mapped``)."""
        conn = self._conn_or_raise()
        k = keys_array(keys)
        n = len(k)
        b = block_ids_array(block_ids)
        p = np.ascontiguousarray(block_ids_array(parts), dtype=np.int32)
        if len(b) != n or len(p) != n:
            raise InvalidArgumentError(f"load_mapped: {n} keys, {len(b)} block ids and {len(p)} parts")
        req = L.c_uint64()
        rc = L.lib().kvferry_submit_load_mapped(conn.handle, self._rid(region), _ptr(k), _ptr(b), _ptr(p), n,
                                                ctypes.byref(req))
        _check(rc, "load_mapped")
        return Ticket(self, conn, req.value, "load_mapped", n, check)

    def load_mapped(self, region, keys, block_ids, parts, timeout: Optional[float] = None,
                    check: bool = True) -> OpResult:
        """Loads blocks saved with another geometry: another page size (part p of a 64-token stored
        block fills a 16-token region block; a 64-token region block takes four 16-token stored
        blocks as parts 0..3), another tensor-parallel head slice (one entry per slice that holds
        the region's heads), NHD/HND and the MLA format conversions. A region block's entries
        succeed or fail together; a failed one is left untouched. ``page_map`` builds the entries
        for a token sequence."""
        return self.load_mapped_async(region, keys, block_ids, parts, check).wait(timeout)

    @staticmethod
    def page_map(keys, stored_tokens: int, block_ids, region_tokens: int):
        """The (keys, block_ids, parts) of a mapped load of the tokens that ``keys`` (stored
        blocks of ``stored_tokens`` each, in order) hold into ``block_ids`` (region blocks of
        ``region_tokens`` each, in order)."""
        k = keys_array(keys)
        b = block_ids_array(block_ids)
        s, r = int(stored_tokens), int(region_tokens)
        if s < 1 or r < 1 or (s % r if s >= r else r % s) != 0:
            raise InvalidArgumentError(f"pages of {s} and {r} tokens: one page size must divide the other")
        if len(k) * s != len(b) * r:
            raise InvalidArgumentError(
                f"{len(k)} stored blocks of {s} tokens do not fill {len(b)} region blocks of {r}")
        if s >= r:
            m = s // r
            idx = np.arange(len(b))
            return k[idx // m], b, (idx % m).astype(np.int32)
        m = r // s
        idx = np.arange(len(k))
        return k, b[idx // m], (idx % m).astype(np.int32)

    def lookup_async(self, region, keys) -> Ticket:
        return self._submit("lookup", region, keys, None, True)

    def save_async(self, region, keys, block_ids, check: bool = True) -> Ticket:
        """Queues a save of ``block_ids[i]`` under ``keys[i]``; returns a Ticket to wait or await."""
        return self._submit("save", region, keys, block_ids, check)

    def load_async(self, region, keys, block_ids, check: bool = True) -> Ticket:
        """Queues a load of ``keys[i]`` into ``block_ids[i]``; returns a Ticket to wait or await."""
        return self._submit("load", region, keys, block_ids, check)

    def lookup(self, region, keys, timeout: Optional[float] = None) -> LookupResult:
        """Which keys are stored: ``.prefix`` (leading keys all stored) and ``.hits``. Misses are
        answers, not errors."""
        return self.lookup_async(region, keys).wait(timeout)

    def save(self, region, keys, block_ids, timeout: Optional[float] = None, check: bool = True) -> OpResult:
        """Saves blocks into the daemon's store. Raises (with per-block statuses) unless every block
        was saved, or check=False."""
        return self.save_async(region, keys, block_ids, check).wait(timeout)

    def load(self, region, keys, block_ids, timeout: Optional[float] = None, check: bool = True) -> OpResult:
        """Loads blocks into the region (converting the format when it differs). A miss raises
        NotFoundError with per-block statuses (check=False returns them instead)."""
        return self.load_async(region, keys, block_ids, check).wait(timeout)

    def _keyed(self, op: str, fn, region, keys, check: bool) -> OpResult:
        conn = self._conn_or_raise()
        k = keys_array(keys)
        n = len(k)
        st = np.zeros(n, dtype=np.int16)
        done = L.c_uint32(0)
        rc = fn(conn.handle, self._rid(region), _ptr(k), n, _ptr(st), ctypes.byref(done))
        if rc != 0 and done.value == 0 and not st.any():
            _check(rc, op)
        if rc == 0 and st.any():  # served, but not for every key: the statuses say which
            rc = int(st[np.nonzero(st)[0][0]])
        r = OpResult(op, st, done.value, rc)
        return r.raise_for_status() if check else r

    def pin(self, region, keys, check: bool = True) -> OpResult:
        """Pins stored blocks (never evicted; released when this client disconnects)."""
        return self._keyed("pin", L.lib().kvferry_pin, region, keys, check)

    def unpin(self, region, keys, check: bool = True) -> OpResult:
        return self._keyed("unpin", L.lib().kvferry_unpin, region, keys, check)

    def evict(self, region=0, keys=(), all: bool = False, all_namespaces: bool = False,
              check: bool = True) -> EvictResult:
        """Evicts the given keys (statuses: 0 evicted, not_found, busy = pinned or in use), or with
        all=True every unpinned block of the region's namespace, or with all_namespaces=True of
        every namespace. ``.evicted`` = blocks evicted."""
        conn = self._conn_or_raise()
        flags = (L.EVICT_ALL if all else 0) | (L.EVICT_ALL_NS if all_namespaces else 0)
        k = keys_array(keys) if not flags else np.zeros((0, 2), dtype=np.uint64)
        n = len(k)
        st = np.zeros(n, dtype=np.int16)
        ev = L.c_uint64(0)
        rc = L.lib().kvferry_evict(conn.handle, self._rid(region), _ptr(k), n, flags, _ptr(st), ctypes.byref(ev))
        if rc != 0 and not st.any():
            _check(rc, "evict")
        if rc == 0 and st.any():  # the daemon serves a partial evict as ok: the statuses say which
            rc = int(st[np.nonzero(st)[0][0]])
        r = EvictResult("evict", st, int(n - np.count_nonzero(st)), rc, evicted=ev.value)
        return r.raise_for_status() if check else r

    # ---- the remote tier (tiers.remote) ----
    def send(self, region, keys, block_ids, peer: str, check: bool = True, peer_region: int = 0,
             peer_block_ids=None) -> OpResult:
        """Prefill → decode: saves the blocks here, then writes them to the peer daemon ``peer``
        (its member id, as ``peers()`` lists it) so that the peer's clients find them. With
        ``peer_region`` (the peer's region id) and ``peer_block_ids`` the blocks also land in that
        region (the decode engine's blocks). Raises with per-block statuses unless every block
        reached the peer, or check=False."""
        conn = self._conn_or_raise()
        k = keys_array(keys)
        b = block_ids_array(block_ids)
        n = len(k)
        if len(b) != n:
            raise InvalidArgumentError(f"send: {n} keys but {len(b)} block ids")
        st = np.zeros(n, dtype=np.int16)
        done = L.c_uint32(0)
        if peer_region:
            pb = block_ids_array(peer_block_ids if peer_block_ids is not None else [])
            if len(pb) != n:
                raise InvalidArgumentError(f"send: {n} keys but {len(pb)} of the peer's block ids")
            rc = L.lib().kvferry_send_into(conn.handle, self._rid(region), _ptr(k), _ptr(b), n, peer.encode(),
                                           int(peer_region), _ptr(pb), _ptr(st), ctypes.byref(done))
        else:
            rc = L.lib().kvferry_send(conn.handle, self._rid(region), _ptr(k), _ptr(b), n, peer.encode(), _ptr(st),
                                      ctypes.byref(done))
        if rc != 0 and done.value == 0 and not st.any():
            _check(rc, "send")
        if rc == 0 and st.any():
            rc = int(st[np.nonzero(st)[0][0]])
        r = OpResult("send", st, done.value, rc)
        return r.raise_for_status() if check else r

    def lookup_wait(self, region, keys, wait: float) -> LookupResult:
        """A lookup that waits up to ``wait`` seconds for keys not stored yet (a peer's send
        landing). ``.hits[i]``: key i is stored now."""
        conn = self._conn_or_raise()
        k = keys_array(keys)
        n = len(k)
        st = np.zeros(n, dtype=np.int16)
        prefix = L.c_uint32(0)
        ms = max(0, min(int(wait * 1000), 600000))
        _check(L.lib().kvferry_lookup_wait(conn.handle, self._rid(region), _ptr(k), n, ms, _ptr(st),
                                           ctypes.byref(prefix)), "lookup_wait")
        return LookupResult("lookup", st, int(np.count_nonzero(st == 0)), 0, prefix=prefix.value)

    def peers(self) -> dict:
        """The remote tier's cluster (as `kvferry peers --json`): self, healthy, members[]."""
        lib = L.lib()
        need = L.c_uint32(0)
        cap = 16384
        while True:
            buf = ctypes.create_string_buffer(cap)
            rc = lib.kvferry_peers_json(self._handle(), buf, cap, ctypes.byref(need))
            if rc == 2 and need.value > cap:
                cap = need.value
                continue
            _check(rc, "peers")
            return json.loads(buf.value.decode())

    # ---- the store and the daemon ----
    def stats(self) -> dict:
        """The daemon's store counters (as `kvferry stats --json`): the host pool's figures at the
        top level, and under ``"tiers"`` one dict per lower tier the daemon runs (an empty list
        for a host-only daemon), each with ``tier`` ("disk", "remote"), ``healthy`` and ``reason``,
        then the disk's storage figures (``capacity_bytes``, ``used_bytes``, ``blocks``,
        ``pinned``, ``evictions``, ``io_errors``, ``checksum_failures``, ``bytes_written``,
        ``bytes_read``) or the remote tier's cluster figures (``member``, ``peers_live``,
        ``peers_lost``, ``blocks_out``, ``bytes_out``, ``blocks_in``, ``bytes_in``, ``errors``)."""
        lib = L.lib()
        s = L.StoreStats()
        s.field_mask = L.STATS_F_STORE
        _check(lib.kvferry_get_stats(self._handle(), ctypes.byref(s)), "stats")
        out = {f: getattr(s, f) for f in L.STATS_FIELDS}
        cap = 8
        arr = (L.TierStats * cap)()
        for e in arr:
            e.field_mask = L.TIER_F_ALL
        n = L.c_uint32(0)
        _check(lib.kvferry_get_tier_stats(self._handle(), arr, cap, ctypes.byref(n)), "stats")
        tiers = []
        for e in arr[: n.value]:
            t = {"tier": e.tier.decode(), "healthy": bool(e.healthy), "reason": e.reason.decode(errors="replace")}
            if e.field_mask & L.TIER_F_STORAGE:
                t.update({f: getattr(e, f) for f in L.TIER_STORAGE_FIELDS})
            if e.field_mask & L.TIER_F_PEERS:
                t["member"] = e.member.decode(errors="replace")
                t.update({f: getattr(e, f) for f in L.TIER_PEER_FIELDS})
            tiers.append(t)
        out["tiers"] = tiers
        return out

    def ls(self, region=0, limit: int = 0) -> List[dict]:
        """Stored blocks of the region's namespace (region 0: every namespace)."""
        cap = limit if limit > 0 else 4096
        arr = (L.LsEntry * cap)()
        n = L.c_uint32()
        _check(L.lib().kvferry_ls(self._handle(), self._rid(region), arr, cap, ctypes.byref(n)), "ls")
        return [
            {
                "namespace": e.ns.decode(errors="replace"),
                "key": key_bytes(e.key.hi, e.key.lo),
                "tier": e.tier.decode(),
                "format": e.format.decode(),
                "bytes": e.bytes,
                "pins": e.pins,
            }
            for e in arr[: n.value]
        ]

    def status(self) -> dict:
        """The daemon's status (as `kvferry status --json`)."""
        lib = L.lib()
        need = L.c_uint32(0)
        cap = 16384
        while True:
            buf = ctypes.create_string_buffer(cap)
            rc = lib.kvferry_daemon_status_json(self._handle(), buf, cap, ctypes.byref(need))
            if rc == 2 and need.value > cap:  # out_of_range: a bigger buffer
                cap = need.value
                continue
            _check(rc, "status")
            return json.loads(buf.value.decode())

    def ping(self, payload: int = 0, timeout: float = 5.0) -> float:
        """A no-op through the rings; returns the round trip in seconds."""
        lib = L.lib()
        h = self._handle()
        t0 = time.perf_counter()
        _check(lib.kvferry_ping(h, 1, payload), "ping")
        ce = (L.Cqe * 4)()
        got = L.c_uint32()
        _check(lib.kvferry_wait(h, ce, 4, int(timeout * 1e6), ctypes.byref(got)), "ping")
        return time.perf_counter() - t0


def version() -> str:
    """libkvferry's version string."""
    return L.lib().kvferry_version().decode()
