"""One `bytes` from a list of buffers, large pieces copied without holding the GIL.

Why: grpcio sends only `bytes`, so a request's tensors must be copied into one.
b"".join does that copy while holding the GIL whenever a piece is not itself a
`bytes` (CPython keeps it then, in case another thread mutates the buffer), so
concurrent callers (Client from many threads) queue behind each
other's copies. Here the result is created uninitialized through the C API
(PyBytes_FromStringAndSize(NULL, n), whose documented use is to be filled before
it is shared), and each piece is copied in with memmove called through ctypes:
a CFUNCTYPE call (ctypes.memmove) releases the GIL, a PYFUNCTYPE one keeps it.
Writing into the new object is safe because nothing else holds it yet; the
caller keeps the pieces alive meanwhile.

Only pieces of _GIL_FREE_MIN_BYTES or more are copied without the GIL: taking
the GIL back can wait up to the interpreter's switch interval (5 ms) while
another thread runs Python code, which a short copy does not repay. A request
with no such piece, or outside CPython (no ctypes.pythonapi), uses b"".join.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np

_GIL_FREE_MIN_BYTES = 8 << 20

# Our own prototypes (setting argtypes on ctypes.pythonapi's shared function
# objects could clash with another library's); PYFUNCTYPE keeps the GIL, as
# C-API calls need.
try:
    _new_bytes = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)(
        ("PyBytes_FromStringAndSize", ctypes.pythonapi))
    _bytes_address = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(
        ("PyBytes_AsString", ctypes.pythonapi))
except AttributeError:  # not CPython
    _new_bytes = None
_copy_without_gil = ctypes.memmove
_copy_with_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)


def concat(pieces: Sequence[Any]) -> bytes:
    """b"".join(pieces) for C-contiguous buffers (bytes, NumPy arrays, memoryviews)."""
    views = [np.frombuffer(p, np.uint8) for p in pieces]  # no copies: views of the pieces
    if _new_bytes is None or all(v.nbytes < _GIL_FREE_MIN_BYTES for v in views):
        return b"".join(pieces)
    out = _new_bytes(None, sum(v.nbytes for v in views))
    at = _bytes_address(out)
    for v in views:
        if v.nbytes:
            copy = _copy_without_gil if v.nbytes >= _GIL_FREE_MIN_BYTES else _copy_with_gil
            copy(at, v.ctypes.data, v.nbytes)
            at += v.nbytes
    return out
