"""NumPy arrays and PyTorch tensors to and from the wire's Tensor (through attnserve._wire).

Copies, per tensor (the numbers docs/python.md quotes):
  to the wire:   a CUDA tensor is first copied to host memory (.cpu(), the one
                 transfer that cannot be avoided); a non-contiguous input is
                 made contiguous (one copy); then 1 copy into the request's
                 `bytes` (attnserve._wire.encode; a tensor of 8 MiB or more
                 without holding the GIL, attnserve._concat), which grpc sends.
  from the wire: none: the array or CPU tensor is a view of the response's
                 `bytes` as grpc delivered it (read-only for NumPy; its start
                 may be unaligned for the dtype, which NumPy and PyTorch on the
                 CPU handle); a CUDA result is one host-to-device copy of it.
gRPC's own copies come on top: grpcio copies the request into its own buffer
before sending, and copies a received message out of its buffers into the
`bytes` handed to the deserializer.
torch is imported only when a torch tensor is passed in.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np

from attnserve import _wire
from attnserve.errors import invalid_argument
from attnserve.v1 import attention_pb2 as pb

# FP8: ml_dtypes' float8_e4m3fn holds the wire's E4M3 codes byte for byte.
_NUMPY_TO_WIRE = {np.dtype(np.float16): pb.FP16, np.dtype(ml_dtypes.bfloat16): pb.BF16,
                  np.dtype(np.float32): pb.FP32,
                  np.dtype(ml_dtypes.float8_e4m3fn): pb.FP8_E4M3}
_WIRE_TO_NUMPY = {wire: dtype for dtype, wire in _NUMPY_TO_WIRE.items()}


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch for NumPy users."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_torch_dtype(x: Any) -> bool:
    """True for a torch.dtype, without importing torch for NumPy users."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.dtype)


def _torch_wire_dtypes() -> dict:
    import torch
    wire = {torch.float16: pb.FP16, torch.bfloat16: pb.BF16, torch.float32: pb.FP32}
    if hasattr(torch, "float8_e4m3fn"):  # torch >= 2.1
        wire[torch.float8_e4m3fn] = pb.FP8_E4M3
    return wire


def to_out(name: str, x: Any) -> _wire.OutTensor:
    """q, k or v of a request (an ndarray or a torch tensor) as its wire dtype, shape and
    bytes: a view of the array's memory when it is C-contiguous on the host."""
    if is_torch(x):
        wire = _torch_wire_dtypes().get(x.dtype)
        if wire is None:
            raise invalid_argument(f"{name}.dtype: expected torch.float16, torch.bfloat16, "
                                   f"torch.float32 or torch.float8_e4m3fn, got {x.dtype}")
        host = x.detach().cpu()  # a CPU tensor stays as it is; CUDA: the device-to-host copy
        # An integer view of the same width keeps the strides (NumPy has no
        # bfloat16 of torch's).
        arr = host.view(_same_width_int(host.dtype)).numpy()
    else:
        arr = np.asarray(x)
        wire = _NUMPY_TO_WIRE.get(arr.dtype)
        if wire is None:
            raise invalid_argument(f"{name}.dtype: expected float16, bfloat16 (ml_dtypes), "
                                   f"float32 or float8_e4m3fn (ml_dtypes), got {arr.dtype}")
    shape = tuple(arr.shape)
    # Bytes of a C-contiguous array: a view (little-endian: the dtypes above are
    # native on x86/Arm); a strided one is gathered here, its one extra copy.
    # uint8 because the buffer protocol does not export ml_dtypes' dtypes.
    data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return _wire.OutTensor(wire, shape, data)


def _same_width_int(dtype):
    import torch
    size = dtype.itemsize
    return torch.int32 if size == 4 else torch.int16 if size == 2 else torch.uint8


def from_wire(name: str, t: Any, like: Any) -> Any:
    """A response tensor (attnserve._wire.InTensor, or the generated pb.Tensor) as the
    kind of `like`: an ndarray viewing t.data, or torch on like's device."""
    dtype = _WIRE_TO_NUMPY.get(t.dtype)
    if dtype is None:
        raise invalid_argument(f"{name}.dtype: the server sent {_dtype_name(t.dtype)}")
    shape = tuple(t.shape)
    data = t.data
    empty = memoryview(data).nbytes == 0
    arr = np.zeros(shape, dtype) if empty else np.frombuffer(data, dtype=dtype).reshape(shape)
    if not is_torch(like):
        return arr
    import torch
    wire_to_torch = {v: k for k, v in _torch_wire_dtypes().items()}
    if arr.size == 0:
        out = torch.empty(shape, dtype=wire_to_torch[t.dtype])
    else:
        with warnings.catch_warnings():
            # The response's bytes are ours alone (nobody else holds them), so a
            # writable view of that immutable buffer is harmless here.
            warnings.simplefilter("ignore", UserWarning)
            out = torch.frombuffer(data, dtype=wire_to_torch[t.dtype]).view(shape)
    return out.to(like.device) if like.device.type != "cpu" else out


def _dtype_name(number: int) -> str:
    try:
        return pb.DType.Name(number)
    except ValueError:  # a value this client's .proto does not know
        return str(number)


def to_offsets(name: str, cu: Optional[Any]) -> Optional[Sequence[int]]:
    """cu_seqlens as Python ints, from a list, an ndarray or a torch tensor (any device)."""
    if cu is None:
        return None
    if is_torch(cu):
        cu = cu.detach().cpu().numpy()
    arr = np.asarray(cu)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise invalid_argument(f"{name}: expected a 1-D sequence of integer offsets, got "
                               f"shape {arr.shape} of {arr.dtype}")
    return arr.astype(np.int64).tolist()
