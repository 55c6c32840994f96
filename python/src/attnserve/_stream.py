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
import time
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
    _transport.NativeStream). `reopen`, when given, makes the stream follow a moved
    K/V cache: a stream the server ends UNAVAILABLE moved-to (it answered what it
    had started and applied none of the rest) is opened again on reopen(address)'s
    method and the unanswered requests are sent again in their first order; each
    request is then kept (its bytes copied) until answered. `moved_to(error)` reads
    the address such an end names (None: the stream ends as without `reopen`)."""

    _END = object()

    def __init__(self, name: str, method: Any, *, timeout: Optional[float] = None,
                 metadata: Optional[Sequence[Tuple[str, str]]] = None,
                 reopen: Optional[Callable[[str], Any]] = None,
                 moved_to: Optional[Callable[[Any], Optional[str]]] = None,
                 reopen_budget_s: float = 60.0):
        self._name = name
        self._pending: Dict[str, list] = {}
        self._lock = threading.Lock()
        # Held while a request is registered and written, and while a reopened stream
        # sends the unanswered ones again: the order on the wire is the order kept.
        self._wlock = threading.Lock()
        self._closed = False
        self._error: Optional[AttnServeError] = None
        self._timeout, self._metadata = timeout, metadata
        self._reopen, self._moved_to, self._budget = reopen, moved_to, reopen_budget_s
        self._give_up: Optional[float] = None
        self._finished = threading.Event()
        self.reopened = 0  # times the stream followed a move
        self._open(method)

    def _open(self, method: Any) -> None:
        """Starts a call on `method`; its reactions know which call they belong to."""
        if isinstance(method, _transport.NativeStream):
            decode = method.decode
            self._reader = None
            self._call = method.start(
                lambda payload: self._on_native_read(decode, payload),
                lambda code, message: self._on_native_done(code, message),
                self._timeout, self._metadata)
            return
        self._requests: "queue.Queue[Any]" = queue.Queue()
        call = method(self._request_iter(self._requests), timeout=self._timeout,
                      metadata=self._metadata)
        self._call = call
        self._reader = threading.Thread(target=self._read, args=(call,),
                                        name="attnserve-stream", daemon=True)
        self._reader.start()

    @property
    def transport(self) -> str:
        """"native" (gRPC C++) or "grpcio": what carries this stream."""
        return "grpcio" if self._reader is not None else "native"

    def _request_iter(self, requests: "queue.Queue[Any]") -> Iterator[Any]:
        while True:
            item = requests.get()
            if item is self._END:
                return
            yield item

    def _write(self, request: Any) -> bool:
        """Writes one request on the call now (under _wlock)."""
        if self._reader is None:
            return self._call.write(request.pieces)  # copied now
        # Serialized later, on grpcio's thread: its bytes are taken now (_wire.Encoded).
        self._requests.put(request if len(request.pieces) == 1 else request.snapshot())
        return True

    def _submit(self, request: Any, parse: Parse,
                on_error: Optional[Callable[[], None]] = None) -> Future:
        """Sends `request`; its future gets parse(response). on_error runs when it fails."""
        future: Future = Future()
        with self._wlock:
            with self._lock:
                if self._closed or self._error is not None:
                    raise self._error or AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                                        f"{self._name}: already closed")
                kept = request.snapshot() if self._reopen is not None else None
                self._pending[request.request_id] = [future, parse, on_error, kept]
            if self._write(kept or request) or self._reopen is not None:
                # A stream that follows moves learns at its end whether it goes on.
                return future
            with self._lock:
                self._pending.pop(request.request_id, None)
                error = self._error
        raise error or AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"{self._name}: the stream has ended")

    @staticmethod
    def _fail(entry: list, error: AttnServeError) -> None:
        future, _, on_error, _ = entry
        if on_error is not None:
            on_error()
        future.set_exception(error)

    def _resolve(self, resp: Any) -> None:
        with self._lock:
            entry = self._pending.pop(resp.request_id, None)
            self._give_up = None
        if entry is None:
            return  # not ours: nothing to resolve
        try:
            entry[0].set_result(entry[1](resp))
        except AttnServeError as e:
            self._fail(entry, e)

    def _follow(self, rpc_error: Any) -> bool:
        """After the call ended with `rpc_error`: reopens the stream where the cache
        moved and sends the unanswered requests again. False: the stream ends."""
        if self._reopen is None or rpc_error is None:
            return False
        address = self._moved_to(rpc_error) if self._moved_to is not None else None
        if address is None:
            return False
        now = time.monotonic()
        with self._lock:
            if self._give_up is None:
                self._give_up = now + self._budget
            if now > self._give_up:
                return False
        try:
            method = self._reopen(address)
        except Exception:  # the address cannot be reached: the stream ends
            return False
        with self._wlock:
            if self._reader is not None:
                self._requests.put(self._END)  # the old call's request thread
            self._open(method)
            with self._lock:
                again = [entry[3] for entry in self._pending.values()]  # insertion order
                closed = self._closed
                self.reopened += 1
            for request in again:
                if not self._write(request):
                    break  # the new call's end says why
            if closed:
                self._writes_done()
        return True

    def _end(self, error: Optional[AttnServeError]) -> None:
        """The stream is over: later submits raise, pending futures get the error."""
        with self._lock:
            self._error = error or AttnServeError(
                grpc.StatusCode.INTERNAL, f"{self._name}: the server ended the stream with "
                "requests unanswered")
            pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._fail(entry, self._error)
        self._finished.set()

    def _read(self, call: Any) -> None:
        rpc_error = None
        try:
            for resp in call:
                self._resolve(resp)
        except grpc.RpcError as e:
            rpc_error = e
        if self._follow(rpc_error):
            return
        self._end(AttnServeError.from_rpc_error(rpc_error) if rpc_error is not None else None)

    def _on_native_read(self, decode: Callable[[bytes], Any], payload: bytes) -> None:
        self._completion_thread = threading.get_ident()  # the completion thread
        self._resolve(decode(payload))

    def _on_native_done(self, code: int, message: str) -> None:  # the completion thread
        self._completion_thread = threading.get_ident()
        rpc_error = _transport.NativeRpcError(code, message) if code else None
        if self._follow(rpc_error):
            return
        self._end(AttnServeError.from_rpc_error(rpc_error) if rpc_error is not None else None)

    _completion_thread = None  # the native thread that resolves this stream's futures

    def _writes_done(self) -> None:
        if self._reader is None:
            self._call.writes_done()
        else:
            self._requests.put(self._END)

    def close(self) -> None:
        """Stops sending and waits for the outstanding responses."""
        with self._wlock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._writes_done()
        # From a future's callback the completion (or reader) thread itself is here:
        # waiting for it would never end, so the outstanding responses arrive after.
        if threading.get_ident() == self._completion_thread or (
                self._reader is not None and threading.current_thread() is self._reader):
            return
        self._finished.wait()

    def cancel(self) -> None:
        """Cancels the stream; pending futures fail with CANCELLED."""
        self._call.cancel()
        self.close()

    def __enter__(self) -> "BidiStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
