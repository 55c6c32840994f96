"""Same-host shared memory (shm.proto): memory a client registers with the server once,
so that calls name spans of it instead of carrying tensor bytes over the socket.

    from attnserve.shm import SystemRegion
    with SystemRegion(client, 64 << 20) as region:       # a POSIX shm object, registered
        off = region.alloc(x.nbytes)
        region.write(off, x)                              # the bytes, into the region
        span = region.span(off, x.nbytes)                 # a SharedTensor naming them

Kinds:
  SystemRegion  a POSIX shared-memory object "/attnserve.<tenant>.<name>" (the key rule
                of SECURITY.md: with tokens, the tenant's own prefix; without, tenant
                "default"), mode 0600, mapped here and opened by the server.
  CudaRegion    device memory of this process (a torch allocation) shared through its
                CUDA IPC handle; the server's kernels read and write it in place (one
                peer copy when the server runs the call on another device). Needs a
                CUDA server, and no --auth_tokens_file (SECURITY.md: CUDA handles name
                no owner, so the server refuses them with authentication on).
close() (or leaving `with`) unregisters the region, then unmaps and unlinks the object
(or lets the device memory go). The server must run with --allow_client_shm; without,
Register answers FAILED_PRECONDITION (AttnServeError).

attnserve.kv's Cache.append_attend(..., shm=True) uses a pool of these per cache: q, k
and v are copied into a region (one copy, instead of the message's), O is written there
by the server and read back (one copy), nothing of them travels on the socket.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
from typing import Any, List, Optional, Tuple

import grpc
import numpy as np

from attnserve import _tensors
from attnserve.errors import AttnServeError, invalid_argument
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve.v1 import shm_pb2, shm_pb2_grpc

ALIGNMENT = 256  # spans start on multiples of this (the C++ client's kShmAlignment)
DEFAULT_TENANT = "default"  # every caller's tenant when the server has no tokens
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory objects
_names = itertools.count(1)


def key_prefix(tenant: str = DEFAULT_TENANT) -> str:
    """The key prefix a tenant's system regions must have (SECURITY.md)."""
    return f"/attnserve.{tenant}."


def _fresh_name() -> str:
    return f"py-{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class Region:
    """What SystemRegion and CudaRegion share: the registration, a bump allocator of
    aligned spans (reset() starts over), the SharedTensor of a span."""

    def __init__(self, client: Any, byte_size: int, name: Optional[str]):
        if byte_size <= 0:
            raise invalid_argument(f"byte_size: expected > 0, got {byte_size}")
        self.client = client
        self.byte_size = int(byte_size)
        self.name = name or _fresh_name()
        self._used = 0
        self._registered = False
        self._stub = shm_pb2_grpc.SharedMemoryStub(client._sync_channel())

    # Registration over the client's grpcio channel (small calls; an AsyncClient's
    # blocking twin: a region is made once and reused, see Pool).
    def _register(self, base: int, **memory: Any) -> None:
        req = shm_pb2.RegisterRegionRequest(name=self.name, byte_size=base + self.byte_size,
                                            **memory)
        try:
            self._stub.Register(req, timeout=self.client._deadline(None))
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None
        self._registered = True

    def _unregister(self) -> None:
        if not self._registered:
            return
        self._registered = False
        try:
            self._stub.Unregister(shm_pb2.UnregisterRegionRequest(name=self.name),
                                  timeout=self.client._deadline(None))
        except grpc.RpcError:
            pass  # the server is gone or the channel closed: nothing holds the region there

    # -- spans -------------------------------------------------------------------
    _base = 0  # where the span offsets start in the registered memory

    def reset(self) -> None:
        """Every span is free again (the calls that used them are over)."""
        self._used = 0

    def alloc(self, nbytes: int) -> int:
        """An aligned span of nbytes; its offset. INVALID_ARGUMENT when it does not fit."""
        offset = _align(self._used)
        if offset + nbytes > self.byte_size:
            raise invalid_argument(f"shm region {self.name}: {nbytes} bytes do not fit "
                                   f"({self.byte_size - offset} of {self.byte_size} left)")
        self._used = offset + nbytes
        return offset

    def span(self, offset: int, nbytes: int) -> pb.SharedTensor:
        """The SharedTensor a call names for [offset, offset + nbytes) of this region."""
        return pb.SharedTensor(region=self.name, offset=self._base + offset, byte_size=nbytes)

    def offset_of(self, span: Any) -> int:
        """The offset here of a span the server named (a response's Tensor.shm)."""
        if span.region != self.name:
            raise AttnServeError(grpc.StatusCode.INTERNAL, f"the server wrote to shm region "
                                 f"{span.region!r}, not {self.name!r}")
        return span.offset - self._base

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class SystemRegion(Region):
    """A POSIX shared-memory object of byte_size bytes, registered under `name` (default:
    unique on the host). key: tenant's prefix + name (tenant "default" unless given)."""

    def __init__(self, client: Any, byte_size: int, *, name: Optional[str] = None,
                 tenant: str = DEFAULT_TENANT, prefix: Optional[str] = None):
        super().__init__(client, byte_size, name)
        self.key = (prefix if prefix is not None else key_prefix(tenant)) + self.name
        if not self.key.startswith("/") or "/" in self.key[1:]:
            raise invalid_argument(f"shm key {self.key!r}: expected \"/\" and then a name "
                                   "without \"/\"")
        self._path = os.path.join(_SHM_DIR, self.key[1:])
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.byte_size)
            self._map = mmap.mmap(fd, self.byte_size)
        except BaseException:
            os.close(fd)
            os.unlink(self._path)
            raise
        os.close(fd)  # the mapping keeps the memory
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)
        try:
            self._register(0, system=shm_pb2.SystemRegion(key=self.key, offset=0))
        except BaseException:
            self._release()
            raise

    def write(self, offset: int, data: Any) -> None:
        """Copies a C-contiguous buffer's bytes to offset."""
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        self.buffer[offset:offset + src.size] = src

    def read(self, offset: int, dtype: Any, shape: Tuple[int, ...]) -> np.ndarray:
        """A copy of the array at offset (the span is reused by the next call)."""
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(
            shape).copy()

    def _release(self) -> None:
        self.buffer = None
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with it
            pass
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unregisters, unmaps and unlinks; idempotent."""
        if getattr(self, "buffer", None) is None:
            return
        self._unregister()
        self._release()


class CudaRegion(Region):
    """byte_size bytes of device memory (a torch allocation on `device`) registered by its
    CUDA IPC handle. The handle names the whole allocation the memory lies in, so spans
    are offset by where this memory starts in it."""

    def __init__(self, client: Any, byte_size: int, *, device: Any = None,
                 name: Optional[str] = None):
        super().__init__(client, byte_size, name)
        import torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self.buffer = torch.empty(self.byte_size, dtype=torch.uint8, device=self.device)
        handle, self._base = ipc_handle(self.buffer)
        self._register(self._base, cuda=shm_pb2.CudaRegion(
            raw_handle=handle, device_id=self.device.index or 0))

    def write(self, offset: int, x: Any) -> None:
        """Copies a torch tensor's bytes to offset (on the device; synchronize() before
        the server reads them)."""
        import torch
        src = x.detach().contiguous()
        if src.device != self.device:
            src = src.to(self.device)
        flat = src.reshape(-1).view(torch.uint8)
        self.buffer[offset:offset + flat.numel()].copy_(flat)

    def synchronize(self) -> None:
        import torch
        torch.cuda.synchronize(self.device)

    def read(self, offset: int, dtype: Any, shape: Tuple[int, ...]) -> Any:
        """A copy, on this device, of the tensor the server wrote at offset."""
        count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.buffer[offset:offset + count].view(dtype).view(shape).clone()

    def close(self) -> None:
        """Unregisters and lets the device memory go; idempotent."""
        if self.buffer is None:
            return
        self._unregister()
        self.buffer = None


CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t), what the server opens


def ipc_handle(t: Any) -> Tuple[bytes, int]:
    """(the 64-byte CUDA IPC handle of the allocation a CUDA torch tensor's memory lies in,
    where the tensor starts in that allocation). Asked of the CUDA driver (the library the
    process already has loaded), not of torch: torch's own export (_share_cuda_) prefixes
    the handle with a version and a type byte since 2.x (66 bytes) and may change again.
    torch's export is the fallback where the driver cannot be asked."""
    import torch
    ptr = int(t.data_ptr())
    try:
        with torch.cuda.device(t.device):
            return _driver_ipc_handle(ptr)
    except OSError:  # no libcuda.so.1 to ask (cannot happen with a CUDA tensor, but be safe)
        return _torch_ipc_handle(t)


def _driver_ipc_handle(ptr: int) -> Tuple[bytes, int]:
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")  # the one the process loaded: same contexts

    def check(result: int, what: str) -> None:
        if result == 0:
            return
        text = ctypes.c_char_p()
        cuda.cuGetErrorString(result, ctypes.byref(text))
        hint = (" (memory from expandable segments cannot be exported: unset "
                "expandable_segments in PYTORCH_CUDA_ALLOC_CONF)"
                if what == "cuIpcGetMemHandle" else "")
        raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{what}: CUDA error {result} "
                             f"({(text.value or b'?').decode()}){hint}")

    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    # The _v2 symbols are the 64-bit device-pointer ABI (cuda.h maps the plain names to them).
    check(cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                       ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
    handle = (ctypes.c_char * CUDA_IPC_HANDLE_BYTES)()
    check(cuda.cuIpcGetMemHandle(handle, base), "cuIpcGetMemHandle")
    return bytes(handle.raw), ptr - base.value


def _torch_ipc_handle(t: Any) -> Tuple[bytes, int]:
    # (device, handle, storage bytes, offset in the allocation, ...); the handle is raw
    # (64 bytes) or a version byte, a type byte ('c': cudaMalloc memory) and the raw handle.
    shared = t.untyped_storage()._share_cuda_()
    handle, base = shared[1], int(shared[3])
    offset = base + t.storage_offset() * t.element_size()
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle, offset
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        return handle[2:], offset
    raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"torch exported a {len(handle)}-byte handle of type {handle[1:2]!r}, "
                         "not cudaMalloc memory (expandable_segments in "
                         "PYTORCH_CUDA_ALLOC_CONF?)")


class Pool:
    """Regions of one kind for calls in flight at once: acquire() lends a region of at
    least n bytes (a new one, or a free one grown), release() takes it back."""

    MIN_BYTES = 1 << 20

    def __init__(self, client: Any, kind: str, *, tenant: str = DEFAULT_TENANT,
                 device: Any = None):
        if kind not in ("system", "cuda"):
            raise invalid_argument(f"shm: expected \"system\" or \"cuda\", got {kind!r}")
        self.client, self.kind, self.tenant, self.device = client, kind, tenant, device
        self._free: List[Region] = []
        self._lent: List[Region] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> Region:
        with self._lock:
            fits = [r for r in self._free if r.byte_size >= nbytes]
            region = min(fits, key=lambda r: r.byte_size) if fits else None
            if region is not None:
                self._free.remove(region)
            elif self._free:  # grow the smallest free one: close it, make a larger one
                small = min(self._free, key=lambda r: r.byte_size)
                self._free.remove(small)
            else:
                small = None
            if region is not None:
                self._lent.append(region)
        if region is None:
            if small is not None:
                small.close()
            size = max(self.MIN_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
            region = (SystemRegion(self.client, size, tenant=self.tenant)
                      if self.kind == "system" else
                      CudaRegion(self.client, size, device=self.device))
            with self._lock:
                self._lent.append(region)
        region.reset()
        return region

    def release(self, region: Region) -> None:
        with self._lock:
            if region in self._lent:
                self._lent.remove(region)
                self._free.append(region)

    def close(self) -> None:
        """Closes every region (lent ones too: their calls are over or fail)."""
        with self._lock:
            regions, self._free, self._lent = self._free + self._lent, [], []
        for region in regions:
            region.close()


class Lease:
    """One call's use of a pooled region: q, k and v written in, O's span named, O read
    back. Released (to the pool) when the call is over, whatever its outcome."""

    def __init__(self, pool: Pool, inputs: List[Tuple[str, Any]], o_bytes: int):
        """inputs: (name, bytes) pairs, host buffers for a system pool, CUDA tensors for a
        CUDA one; o_bytes: O's size (0: no O)."""
        sizes = [nbytes(x) for _, x in inputs]
        need = sum(_align(n) for n in sizes) + _align(o_bytes)
        self.pool = pool
        self.region = pool.acquire(need)
        self.spans = {}
        for (name, x), n in zip(inputs, sizes):
            offset = self.region.alloc(n)
            self.region.write(offset, x)
            self.spans[name] = self.region.span(offset, n)
        self.o = self.region.span(self.region.alloc(o_bytes), o_bytes) if o_bytes else None
        if pool.kind == "cuda":
            self.region.synchronize()  # the server reads them from another process

    def read_o(self, wire_dtype: int, shape: Tuple[int, ...], span: Any, like: Any) -> Any:
        """O as like's kind: from the span the server named (checked to be ours)."""
        offset = self.region.offset_of(span)
        if self.pool.kind == "cuda":
            import torch
            torch_dtype = {v: k for k, v in _tensors._torch_wire_dtypes().items()}[wire_dtype]
            return self.region.read(offset, torch_dtype, shape)
        arr = self.region.read(offset, _tensors._WIRE_TO_NUMPY[wire_dtype], shape)
        return _tensors.from_wire("o", _HostTensor(wire_dtype, shape, arr), like)

    def release(self) -> None:
        if self.region is not None:
            self.pool.release(self.region)
            self.region = None


class _HostTensor:
    """An array as _tensors.from_wire reads a response tensor."""

    def __init__(self, dtype: int, shape: Tuple[int, ...], arr: np.ndarray):
        self.dtype, self.shape = dtype, shape
        self.data = arr.reshape(-1).view(np.uint8)


def nbytes(x: Any) -> int:
    """Bytes of an ndarray or a torch tensor."""
    return int(x.numel() * x.element_size()) if _tensors.is_torch(x) else int(np.asarray(x).nbytes)


def kind_for(client: Any, shm: Any, like: Any) -> Optional[str]:
    """Which region kind a call with shm=... uses: None (off), "system" or "cuda".
    True: "cuda" for a CUDA torch tensor when the server's backend is CUDA, else "system"."""
    if shm is None or shm is False:
        return None
    if shm is True:
        on_gpu = _tensors.is_torch(like) and like.device.type == "cuda"
        return "cuda" if on_gpu and server_backend(client) == "cuda" else "system"
    if shm not in ("system", "cuda"):
        raise invalid_argument(f"shm: expected True, False, \"system\" or \"cuda\", got {shm!r}")
    if shm == "cuda" and not (_tensors.is_torch(like) and like.device.type == "cuda"):
        raise invalid_argument("shm: \"cuda\" needs q (or k) as a CUDA torch tensor")
    return shm


def server_backend(client: Any) -> str:
    """The server's backend ("cpu" or "cuda"), asked once per client (blocking)."""
    backend = getattr(client, "_shm_backend", None)
    if backend is None:
        stub = pb_grpc.AttentionStub(client._sync_channel())
        try:
            backend = stub.GetServerInfo(pb.GetServerInfoRequest(),
                                         timeout=client._deadline(None)).backend
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None
        client._shm_backend = backend
    return backend
