"""A bidirectional gRPC stream with many requests in flight, each answered by a Future.

What ForwardStream and the K/V API's AppendAttendStream share: a queue feeding
the request iterator, one reader thread matching responses to futures on
request_id, and the rule for a stream that ends early (every pending future
gets the stream's error).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, Optional

import grpc

from attnserve.errors import AttnServeError

# Turns one response into the future's result; raises AttnServeError for a
# failed request (the future then fails, the stream goes on).
Parse = Callable[[Any], Any]


class BidiStream:
    """Base of the synchronous streams: subclasses build requests and call _submit()."""

    _END = object()

    def __init__(self, name: str, open_call: Callable[[Iterator[Any]], Any]):
        self._name = name
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._pending: Dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._error: Optional[AttnServeError] = None
        self._call = open_call(self._request_iter())
        self._reader = threading.Thread(target=self._read, name="attnserve-stream", daemon=True)
        self._reader.start()

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
        # Serialized later, on grpcio's thread: its bytes are taken now (_wire.Encoded).
        self._requests.put(request.snapshot())
        return future

    @staticmethod
    def _fail(entry: tuple, error: AttnServeError) -> None:
        future, _, on_error = entry
        if on_error is not None:
            on_error()
        future.set_exception(error)

    def _read(self) -> None:
        try:
            for resp in self._call:
                with self._lock:
                    entry = self._pending.pop(resp.request_id, None)
                if entry is None:
                    continue  # not ours: nothing to resolve
                try:
                    entry[0].set_result(entry[1](resp))
                except AttnServeError as e:
                    self._fail(entry, e)
            error = None
        except grpc.RpcError as e:
            error = AttnServeError.from_rpc_error(e)
        with self._lock:
            self._error = error or AttnServeError(
                grpc.StatusCode.INTERNAL, f"{self._name}: the server ended the stream with "
                "requests unanswered")
            pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._fail(entry, self._error)

    def close(self) -> None:
        """Stops sending and waits for the outstanding responses."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._requests.put(self._END)
        self._reader.join()

    def cancel(self) -> None:
        """Cancels the stream; pending futures fail with CANCELLED."""
        self._call.cancel()
        self.close()

    def __enter__(self) -> "BidiStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
