"""One `bytes` from a list of buffers, the copies made without holding the GIL.

Why: grpcio sends only `bytes`, so a request's tensors must be copied into one.
b"".join does that copy while holding the GIL whenever a piece is not itself a
`bytes` (CPython keeps it then, in case another thread mutates the buffer), so
concurrent callers (Client from many threads, issue 12) queue behind each
other's copies. Here the result is created uninitialized through the C API
(PyBytes_FromStringAndSize(NULL, n), whose documented use is to be filled before
it is shared), and each piece is copied in with ctypes.memmove, a foreign call
during which ctypes releases the GIL. Writing into the new object is safe
because nothing else holds it yet; the caller keeps the pieces alive meanwhile.
Outside CPython (no ctypes.pythonapi), or for small totals, b"".join is used.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np

# Below this many bytes the copy is too short for the GIL to matter.
_GIL_FREE_MIN_BYTES = 1 << 20

try:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _bytes_address = ctypes.pythonapi.PyBytes_AsString
    _bytes_address.restype = ctypes.c_void_p
    _bytes_address.argtypes = (ctypes.py_object,)
except AttributeError:  # not CPython
    _new_bytes = None


def concat(pieces: Sequence[Any]) -> bytes:
    """b"".join(pieces) for C-contiguous buffers (bytes, NumPy arrays, memoryviews)."""
    views = [np.frombuffer(p, np.uint8) for p in pieces]  # no copies: views of the pieces
    total = sum(v.nbytes for v in views)
    if _new_bytes is None or total < _GIL_FREE_MIN_BYTES:
        return b"".join(pieces)
    out = _new_bytes(None, total)
    at = _bytes_address(out)
    for v in views:
        if v.nbytes:
            ctypes.memmove(at, v.ctypes.data, v.nbytes)
            at += v.nbytes
    return out
