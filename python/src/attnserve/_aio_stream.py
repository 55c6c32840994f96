"""The asyncio twin of attnserve._stream: a grpc.aio bidirectional stream, many requests in flight.

What AsyncForwardStream and the K/V API's AsyncAppendAttendStream share: the
write of each request, matching responses to asyncio futures on request_id,
and the rule for a stream that ends early (every pending future gets the
stream's error, and its on_error runs).

Two transports (attnserve._transport says which the stub method is):
  native  each request's bytes are copied into one message and queued on the
          gRPC C++ call at submit(); the channel's completion thread hands each
          response and the call's end to the loop (call_soon_threadsafe).
  grpcio  a grpc.aio call: each request written with call.write(), one reader
          task awaiting call.read().
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import grpc
import grpc.aio

from attnserve import _transport
from attnserve.errors import AttnServeError

# Turns one response into the future's result; raises AttnServeError for a
# failed request (the future then fails, the stream goes on).
Parse = Callable[[Any], Any]


class AsyncBidiStream:
    """Base of the asyncio streams: subclasses build requests and await _submit().

    `method` is the stub's stream method: a grpc.aio multi-callable (the call is
    opened without a request iterator; requests go out with call.write()) or a
    _transport.NativeStream. Construct it inside a running event loop.
    """

    def __init__(self, name: str, method: Any, *, timeout: Optional[float] = None,
                 metadata: Optional[Sequence[Tuple[str, str]]] = None):
        self._name = name
        self._pending: Dict[str, tuple] = {}
        self._error: Optional[AttnServeError] = None
        self._closed = False
        loop = asyncio.get_running_loop()
        if isinstance(method, _transport.NativeStream):
            self._decode = method.decode
            self._ended = loop.create_future()
            self._reader = None
            self._call = method.start(_transport.on_loop(loop, self._on_native_read),
                                      _transport.on_loop(loop, self._on_native_done),
                                      timeout, metadata)
            return
        self._call = method(timeout=timeout, metadata=metadata)
        # grpc.aio takes one write at a time: coroutines submitting at once queue here
        # (in submission order: asyncio.Lock is first come, first served).
        self._write_lock = asyncio.Lock()
        self._reader = loop.create_task(self._read())

    @property
    def transport(self) -> str:
        """"native" (gRPC C++) or "grpcio": what carries this stream."""
        return "grpcio" if self._reader is not None else "native"

    async def _submit(self, request: Any, parse: Parse,
                      on_error: Optional[Callable[[], None]] = None) -> "asyncio.Future":
        """Sends `request`; returns the future of parse(response). on_error runs when the
        request fails after it was sent. If it cannot be sent, raises AttnServeError
        and on_error does not run (the caller undoes what it prepared)."""
        if self._closed or self._error is not None:
            raise self._error or AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                                f"{self._name}: already closed")
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = (future, parse, on_error)
        if self._reader is None:
            if not self._call.write(request.pieces):  # copied now
                self._pending.pop(request.request_id, None)
                raise self._error or AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                                    f"{self._name}: the stream has ended")
            return future
        try:
            async with self._write_lock:
                await self._call.write(request)
        except (grpc.RpcError, asyncio.InvalidStateError) as e:
            # The stream is over; the reader tells the other pending futures.
            self._pending.pop(request.request_id, None)
            if isinstance(e, grpc.RpcError):
                raise AttnServeError.from_rpc_error(e) from None
            raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{self._name}: the stream has ended") from None
        return future

    @staticmethod
    def _fail(entry: tuple, error: BaseException) -> None:
        future, _, on_error = entry
        if on_error is not None:
            on_error()
        if not future.done():
            future.set_exception(error)

    def _resolve(self, resp: Any) -> None:
        entry = self._pending.pop(resp.request_id, None)
        if entry is None or entry[0].done():
            return  # not ours, or its caller cancelled the future
        try:
            entry[0].set_result(entry[1](resp))
        except AttnServeError as e:
            self._fail(entry, e)
        except Exception as e:  # a response we could not read: the server applied it
            entry[0].set_exception(e)

    def _on_native_read(self, payload: bytes) -> None:  # on the loop
        self._resolve(self._decode(payload))

    def _on_native_done(self, code: int, message: str) -> None:  # on the loop
        if code == grpc.StatusCode.CANCELLED.value[0]:
            error = AttnServeError(grpc.StatusCode.CANCELLED, f"{self._name}: cancelled")
        elif code:
            error = AttnServeError.from_rpc_error(_transport.NativeRpcError(code, message))
        else:
            error = AttnServeError(grpc.StatusCode.INTERNAL, f"{self._name}: the server ended "
                                   "the stream with requests unanswered")
        self._end(error)
        if not self._ended.done():
            self._ended.set_result(None)

    async def _read(self) -> None:
        error: Optional[AttnServeError] = None
        try:
            while True:
                resp = await self._call.read()
                if resp is grpc.aio.EOF:
                    break
                self._resolve(resp)
        except grpc.RpcError as e:
            error = AttnServeError.from_rpc_error(e)
        except asyncio.CancelledError:
            # grpc.aio raises this from read() once the call is cancelled (cancel());
            # if this task itself was cancelled, the pending futures still get told.
            self._end(AttnServeError(grpc.StatusCode.CANCELLED, f"{self._name}: cancelled"))
            if not self._call.cancelled():
                raise
            return
        self._end(error or AttnServeError(
            grpc.StatusCode.INTERNAL, f"{self._name}: the server ended the stream with "
            "requests unanswered"))

    def _end(self, error: AttnServeError) -> None:
        """The stream is over: later submits raise `error`, pending futures get it."""
        self._error = error
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._fail(entry, error)

    async def close(self) -> None:
        """Stops sending and waits for the outstanding responses."""
        if self._closed:
            return
        self._closed = True
        if self._reader is None:
            self._call.writes_done()
            await asyncio.shield(self._ended)
            return
        try:
            await self._call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the reader reports the stream's error to the pending futures
        await self._reader

    async def cancel(self) -> None:
        """Cancels the stream; pending futures fail with CANCELLED."""
        self._call.cancel()
        await self.close()

    async def __aenter__(self) -> "AsyncBidiStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
