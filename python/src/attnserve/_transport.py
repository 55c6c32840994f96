"""Which transport carries the tensor-carrying calls: the one place that decides.

The calls are Forward, Echo and ForwardStream (attnserve.v1.Attention), AppendAttend and
AppendAttendStream (attnserve.v1.KvCache), of Client and AsyncClient alike: each request
is attnserve._wire's pieces and each response is read by its decoder. Two transports:

  native  attnserve._native, gRPC C++ (built by `pip install ./python` where gRPC C++'s
          development files are found; setup.py). A blocking unary call sends the request
          as gRPC slices over the pieces (no copy of a tensor) and waits in place; the
          asyncio unary calls do the same without waiting, and a stream message is copied
          once when submitted (the caller may reuse its arrays). Responses come back as
          one `bytes` (one copy). Asynchronous completions are handed over by the
          channel's completion thread: to a sync stream's futures directly, to asyncio
          through loop.call_soon_threadsafe (the loop wakes on its own self-pipe).
  grpcio  grpcio's channel, as every other call: the request joined into one `bytes`
          (attnserve._concat), then grpcio's own copy out and its three copies back.
Measured per call in bench/NOTES-python.md.

$ATTNSERVE_TRANSPORT chooses:
  auto (default)  native when attnserve._native imports and the channel is one it can
                  open (plain text, no bearer token: it has no TLS or token support), else grpcio;
  native          as auto, but an error when attnserve._native does not import (a build
                  that should have it, e.g. CI, proves it ran);
  grpcio          grpcio always.
Every other RPC (GetServerInfo, health, the K/V API's cache and sequence calls) uses grpcio
whichever is chosen.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import weakref
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
    channel = _native.Channel(target, list(options))
    _open_channels.add(channel)
    return channel


# Native channels still open, closed at exit: their completion thread must not hand
# anything to an interpreter that is shutting down.
_open_channels: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def _close_open_channels() -> None:
    for channel in list(_open_channels):
        channel.close()


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


def _metadata(metadata: Optional[Sequence[Tuple[str, str]]]) -> Optional[list]:
    return None if metadata is None else list(metadata)


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None],
            *first: Any) -> Callable[..., None]:
    """A completion callback for the native channel's thread: runs fn(*first, *its args) on
    `loop` (call_soon_threadsafe wakes it; nothing polls)."""
    call_soon = loop.call_soon_threadsafe

    def deliver(*args: Any) -> None:
        try:
            call_soon(fn, *first, *args)
        except RuntimeError:  # the loop is closed: nobody waits for this any more
            pass
    return deliver


def _settle(future: "asyncio.Future", code: int, payload: Any) -> None:
    if not future.done():
        future.set_result((code, payload))


class NativeAsyncUnary:
    """One unary method on a native channel for asyncio, awaited as grpc.aio's are:
    await rpc(request, timeout=None, metadata=None) -> the decoded response. The request's
    pieces are read by gRPC after this returns to the loop: the arrays must not change
    until the call is done (as for the blocking call)."""

    def __init__(self, channel: Any, path: str, decode: Callable[[bytes], Any]):
        self._channel, self._path, self._decode = channel, path, decode

    async def __call__(self, request: _wire.Encoded, timeout: Optional[float] = None,
                       metadata: Optional[Sequence[Tuple[str, str]]] = None) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call = self._channel.start_unary(self._path, request.pieces, timeout,
                                         _metadata(metadata), on_loop(loop, _settle, future))
        try:
            code, payload = await future
        except asyncio.CancelledError:
            call.cancel()
            raise
        if code:
            raise NativeRpcError(code, payload)
        return self._decode(payload)


class NativeStream:
    """One bidirectional-stream method on a native channel. start() opens a call:
    call.write(pieces) -> bool, call.writes_done(), call.cancel(); on_read(bytes) runs on
    the channel's completion thread for each response in order, then on_done(code, message)
    once (code 0: the server ended the stream normally). decode() reads a response."""

    def __init__(self, channel: Any, path: str, decode: Callable[[bytes], Any]):
        self._channel, self._path, self.decode = channel, path, decode

    def start(self, on_read: Callable[[bytes], None], on_done: Callable[[int, str], None],
              timeout: Optional[float] = None,
              metadata: Optional[Sequence[Tuple[str, str]]] = None) -> Any:
        return self._channel.start_stream(self._path, timeout, _metadata(metadata), on_read,
                                          on_done)
