"""A bidirectional gRPC stream with many requests in flight, each answered by a Future.

What ForwardStream and the K/V API's AppendAttendStream share: sending each
request, matching responses to futures on request_id, and the rule for a
stream that ends early (every pending future gets the stream's error).

Two transports (attnserve._transport says which the stub method is):
  native  the request's bytes are copied into one message and queued on the
          gRPC C++ call at submit(); responses resolve their futures on the
          channel's completion thread.
  grpcio  a queue feeds grpcio's request iterator (the request's bytes taken at
          submit(): Encoded.snapshot), one reader thread resolves the futures.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import grpc

from attnserve import _transport
from attnserve.errors import AttnServeError

# Turns one response into the future's result; raises AttnServeError for a
# failed request (the future then fails, the stream goes on).
Parse = Callable[[Any], Any]


class BidiStream:
    """Base of the synchronous streams: subclasses build requests and call _submit().

    `method` is the stub's stream method (grpcio's multi-callable or a
    _transport.NativeStream)."""

    _END = object()

    def __init__(self, name: str, method: Any, *, timeout: Optional[float] = None,
                 metadata: Optional[Sequence[Tuple[str, str]]] = None):
        self._name = name
        self._pending: Dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._error: Optional[AttnServeError] = None
        if isinstance(method, _transport.NativeStream):
            self._decode = method.decode
            self._ended = threading.Event()
            self._reader = None
            self._call = method.start(self._on_native_read, self._on_native_done, timeout,
                                      metadata)
            return
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._call = method(self._request_iter(), timeout=timeout, metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="attnserve-stream", daemon=True)
        self._reader.start()

    @property
    def transport(self) -> str:
        """"native" (gRPC C++) or "grpcio": what carries this stream."""
        return "grpcio" if self._reader is not None else "native"

    def _request_iter(self) -> Iterator[Any]:
        while True:
            item = self._requests.get()
            if item is self._END:
                return
            yield item

    def _submit(self, request: Any, parse: Parse,
                on_error: Optional[Callable[[], None]] = None) -> Future:
        """Sends `request`; its future gets parse(response). on_error runs when it fails."""
        future: Future = Future()
        with self._lock:
            if self._closed or self._error is not None:
                raise self._error or AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                                    f"{self._name}: already closed")
            self._pending[request.request_id] = (future, parse, on_error)
        if self._reader is None:
            if not self._call.write(request.pieces):  # copied now
                with self._lock:
                    self._pending.pop(request.request_id, None)
                    error = self._error
                raise error or AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                              f"{self._name}: the stream has ended")
            return future
        # Serialized later, on grpcio's thread: its bytes are taken now (_wire.Encoded).
        self._requests.put(request.snapshot())
        return future

    @staticmethod
    def _fail(entry: tuple, error: AttnServeError) -> None:
        future, _, on_error = entry
        if on_error is not None:
            on_error()
        future.set_exception(error)

    def _resolve(self, resp: Any) -> None:
        with self._lock:
            entry = self._pending.pop(resp.request_id, None)
        if entry is None:
            return  # not ours: nothing to resolve
        try:
            entry[0].set_result(entry[1](resp))
        except AttnServeError as e:
            self._fail(entry, e)

    def _end(self, error: Optional[AttnServeError]) -> None:
        """The stream is over: later submits raise, pending futures get the error."""
        with self._lock:
            self._error = error or AttnServeError(
                grpc.StatusCode.INTERNAL, f"{self._name}: the server ended the stream with "
                "requests unanswered")
            pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._fail(entry, self._error)

    def _read(self) -> None:
        try:
            for resp in self._call:
                self._resolve(resp)
            error = None
        except grpc.RpcError as e:
            error = AttnServeError.from_rpc_error(e)
        self._end(error)

    def _on_native_read(self, payload: bytes) -> None:  # the completion thread
        self._completion_thread = threading.get_ident()
        self._resolve(self._decode(payload))

    def _on_native_done(self, code: int, message: str) -> None:  # the completion thread
        self._completion_thread = threading.get_ident()
        self._end(AttnServeError.from_rpc_error(_transport.NativeRpcError(code, message))
                  if code else None)
        self._ended.set()

    _completion_thread = None  # the native thread that resolves this stream's futures

    def close(self) -> None:
        """Stops sending and waits for the outstanding responses."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._reader is None:
            self._call.writes_done()
            # From a future's callback the completion thread itself is here: waiting
            # for it would never end, so the outstanding responses arrive after.
            if threading.get_ident() != self._completion_thread:
                self._ended.wait()
            return
        self._requests.put(self._END)
        if threading.current_thread() is not self._reader:  # as above, for the reader thread
            self._reader.join()

    def cancel(self) -> None:
        """Cancels the stream; pending futures fail with CANCELLED."""
        self._call.cancel()
        self.close()

    def __enter__(self) -> "BidiStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
