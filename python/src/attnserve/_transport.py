"""Which transport carries the synchronous client's tensor-carrying unary calls: the one place
that decides.

The calls are Forward, Echo (attnserve.v1.Attention) and AppendAttend (attnserve.v1.KvCache),
each a request of attnserve._wire's pieces and a response its decoder reads. Two transports:

  native  attnserve._native, gRPC C++ (built by `pip install ./python` where gRPC C++'s
          development files are found; setup.py): the request goes out as gRPC slices over
          the pieces (no copy of a tensor), the response comes back as one `bytes` (one copy).
  grpcio  grpcio's channel, as every other call: the request joined into one `bytes`
          (attnserve._concat), then grpcio's own copy out and its three copies back.
Measured per call in bench/NOTES-python.md.

$ATTNSERVE_TRANSPORT chooses:
  auto (default)  native when attnserve._native imports and the channel is one it can
                  open (plain text, no bearer token: it has no TLS or token support), else grpcio;
  native          as auto, but an error when attnserve._native does not import (a build
                  that should have it, e.g. CI, proves it ran);
  grpcio          grpcio always.
Streams, the asyncio client and every other RPC use grpcio whichever is chosen.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence, Tuple

import grpc

from attnserve import _wire

ENV = "ATTNSERVE_TRANSPORT"
CHOICES = ("auto", "native", "grpcio")

try:
    from attnserve import _native
    _NATIVE_MISSING = ""
except ImportError as e:  # not built here (no gRPC C++), or its libraries not found
    _native = None
    _NATIVE_MISSING = str(e)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def choice() -> str:
    """$ATTNSERVE_TRANSPORT, checked."""
    value = os.environ.get(ENV, "auto") or "auto"
    if value not in CHOICES:
        raise ValueError(f"${ENV}: expected one of {', '.join(CHOICES)}, got {value!r}")
    return value


def native_channel(target: str, options: Sequence[Tuple[str, object]], *,
                   plain_text: bool) -> Optional[Any]:
    """A native channel for a synchronous client with these options, or None for grpcio."""
    wanted = choice()
    if wanted == "grpcio":
        return None
    if _native is None:
        if wanted == "native":
            raise RuntimeError(f"${ENV}=native, but attnserve._native does not import: "
                               f"{_NATIVE_MISSING}")
        return None
    if not plain_text:
        return None
    return _native.Channel(target, list(options))


class NativeRpcError(grpc.RpcError):
    """A failed native call, read as grpcio's errors are (code(), details())."""

    def __init__(self, code: int, details: str):
        super().__init__(details)
        self._code = _CODES.get(code, grpc.StatusCode.UNKNOWN)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class NativeUnary:
    """One unary method on a native channel, called as grpcio's are:
    rpc(request, timeout=None, metadata=None) -> the decoded response."""

    def __init__(self, channel: Any, path: str, decode: Callable[[bytes], Any]):
        self._channel, self._path, self._decode = channel, path, decode

    def __call__(self, request: _wire.Encoded, timeout: Optional[float] = None,
                 metadata: Optional[Sequence[Tuple[str, str]]] = None) -> Any:
        code, payload = self._channel.unary(self._path, request.pieces, timeout,
                                            None if metadata is None else list(metadata))
        if code:
            raise NativeRpcError(code, payload)
        return self._decode(payload)
