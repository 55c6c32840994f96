"""attnserve.kv for asyncio: AsyncCache, the same operations as coroutines on an AsyncClient.

    async with AsyncClient(target) as client, \
            AsyncCache.create(client, num_layers=4, num_heads_kv=2, head_dim=64,
                              dtype="float32", capacity_tokens=1 << 16) as cache, \
            cache.sequences(2) as seqs, \
            cache.stream() as stream:
        o = await cache.append_attend(0, seqs, q, k, v)          # unary
        o = await stream.append_attend(1, seqs, q, k, v)         # on the stream
        await seqs[0].truncate(3)

Ownership as in attnserve.kv: `async with` drops the cache, frees the
sequences and closes the stream on the way out, also when the body raises.
AsyncCache.create(), cache.sequence(), sequences() and fork() (and a
Sequence's fork()) return objects that are both awaitable (`cache = await
AsyncCache.create(...)`, then `await cache.close()`) and async context
managers (`async with AsyncCache.create(...) as cache:`).

Sequences of an AsyncCache are the same Sequence/Sequences objects: their
fork(), truncate() and free() return awaitables, and they are `async with`
context managers. The operations, their bookkeeping and the retry rule are
attnserve.kv's (CacheBase); only the calls are awaited here.

Many calls in flight: unary append_attend() calls under asyncio.gather on
different (sequence, layer) pairs (calls on the same pair must be awaited in
order: a unary call may overtake another on the wire); or the stream
(AsyncAppendAttendStream, one AppendAttendStream RPC), where calls on the
same (sequence, layer) apply in submission order, so a whole decode step can
be in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Dict, Generic, Iterable, List, Optional, Sequence as Seq, \
    TypeVar, Union

import grpc

from attnserve import shm as _shm
from attnserve._aio_stream import AsyncBidiStream
from attnserve.aio import AsyncClient
from attnserve.errors import AttnServeError
from attnserve.kv import AppendAttendResult, CacheBase, Op, Sequence, Sequences, _AppendCall
from attnserve.v1 import kv_pb2


T = TypeVar("T")


class Made(Generic[T]):
    """What the asyncio factories return: `await` it for the object, or `async with`
    it to get the object and close (drop/free) it on the way out."""

    def __init__(self, making: Awaitable[T]):
        self._making = making
        self._made: Any = None

    def __await__(self):
        return self._making.__await__()

    async def __aenter__(self) -> T:
        self._made = await self._making
        return await self._made.__aenter__()

    async def __aexit__(self, *exc) -> None:
        await self._made.__aexit__(*exc)


class AsyncCache(CacheBase):
    """attnserve.kv.Cache for asyncio; make one with `AsyncCache.create(...)`
    (Cache's arguments; await it, or `async with` it), drop it with
    `await close()` or on leaving `async with`."""

    @classmethod
    def create(cls, client: AsyncClient, *, num_layers: int, num_heads_kv: int,
               head_dim: int, dtype: Any, capacity_tokens: Optional[int] = None,
               capacity_bytes: Optional[int] = None, page_size: int = 0,
               cache_id: Optional[str] = None, device: Optional[int] = None,
               reserve: bool = False, timeout: Optional[float] = None, shm: Any = None,
               shm_tenant: str = _shm.DEFAULT_TENANT, head_dim_v: int = 0,
               v_in_k: bool = False) -> Made["AsyncCache"]:
        """CreateCache (see attnserve.kv.Cache for the arguments). With shm, a region is
        registered by a blocking call when the cache's pool first needs one (or a larger
        one), on this client's blocking twin channel."""
        self = cls()
        req = self._init(client, num_layers, num_heads_kv, head_dim, dtype, capacity_tokens,
                         capacity_bytes, page_size, cache_id, device, reserve, timeout, shm,
                         shm_tenant, head_dim_v, v_in_k)

        async def making() -> "AsyncCache":
            await self._run(self._op_create_cache(req))
            return self
        return Made(making())

    async def _call(self, method: str, request: Any, timeout: Optional[float] = None) -> Any:
        rpc = getattr(self.client._kv, method)
        try:
            return await rpc(request, timeout=self._deadline_of(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None

    async def _run(self, op: Op) -> Any:
        """Runs an operation's RPCs one after another, awaiting each (see kv.Op)."""
        try:
            step = next(op)
            while True:
                try:
                    resp = await self._call(*step)
                except AttnServeError as e:
                    step = op.throw(e)
                else:
                    step = op.send(resp)
        except StopIteration as done:
            return done.value

    def _go(self, op: Op) -> Made[Any]:
        """How Sequence runs its operations here: awaitable (and `async with` for fork)."""
        return Made(self._run(op))

    async def close(self) -> None:
        await self._run(self._op_close())

    drop = close

    async def __aenter__(self) -> "AsyncCache":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def stats(self, *, timeout: Optional[float] = None) -> kv_pb2.CacheStats:
        return await self._run(self._op_stats(timeout))

    async def server_lengths(self, sequences: Iterable[Sequence], *,
                             timeout: Optional[float] = None) -> Dict[int, List[int]]:
        return await self._run(self._op_server_lengths(sequences, timeout))

    async def sync(self, sequences: Iterable[Sequence], *,
                   timeout: Optional[float] = None) -> None:
        await self._run(self._op_sync(sequences, timeout))

    def sequence(self, sequence_id: Optional[int] = None, *,
                 timeout: Optional[float] = None) -> Made[Sequence]:
        """One new empty sequence (await it, or `async with` it to free it after)."""
        ids = 1 if sequence_id is None else [sequence_id]

        async def making() -> Sequence:
            return (await self._run(self._op_sequences(ids, timeout)))[0]
        return Made(making())

    def sequences(self, count_or_ids: Union[int, Iterable[int]], *,
                  timeout: Optional[float] = None) -> Made[Sequences]:
        """New empty sequences, all or none (await, or `async with` to free them after)."""
        return Made(self._run(self._op_sequences(count_or_ids, timeout)))

    def fork(self, source: Sequence, length: Optional[int] = None, *, count: int = 1,
             timeout: Optional[float] = None) -> Made[Sequences]:
        """Cache.fork (await, or `async with` to free the forks after)."""
        return Made(self._run(self._op_fork(source, length, count, timeout)))

    async def truncate(self, sequence: Sequence, length: int, layer: Optional[int] = None, *,
                       timeout: Optional[float] = None) -> kv_pb2.CacheStats:
        return await self._run(self._op_truncate(sequence, length, layer, timeout))

    async def free(self, sequences: Iterable[Sequence], *,
                   timeout: Optional[float] = None) -> None:
        await self._run(self._op_free(sequences, timeout))

    async def append_attend(self, layer: int, sequences: Seq[Sequence], q: Any, k: Any = None,
                            v: Any = None, *, return_lse: bool = False,
                            timeout: Optional[float] = None, **options: Any) -> Any:
        """Cache.append_attend as a coroutine: O, or (O, LSE) with return_lse."""
        result = await self.append_attend_result(layer, sequences, q, k, v,
                                                 return_lse=return_lse, timeout=timeout,
                                                 **options)
        return (result.o, result.lse) if return_lse else result.o

    async def append_attend_result(self, layer: int, sequences: Seq[Sequence], q: Any,
                                   k: Any = None, v: Any = None, *,
                                   timeout: Optional[float] = None,
                                   **options: Any) -> AppendAttendResult:
        return await self._run(self._op_append_attend(layer, sequences, q, k, v, timeout,
                                                      options))

    def stream(self, *, timeout: Optional[float] = None) -> "AsyncAppendAttendStream":
        """An AsyncAppendAttendStream on this cache (`async with`, or await close())."""
        return AsyncAppendAttendStream(self, timeout=timeout)


class AsyncAppendAttendStream(AsyncBidiStream):
    """attnserve.kv.AppendAttendStream for asyncio: many append-and-attend calls in
    flight on one AppendAttendStream RPC.

    `await submit(...)` (append_attend()'s arguments) sends one call and returns
    an asyncio.Future of its AppendAttendResult. Calls on the same (sequence,
    layer) apply in submission order on the server, each expecting the length
    the previous one leaves (the tracked lengths advance at submit), so a
    decode step's calls can all be in flight. A failed call fails only its own
    future and rolls its lengths back (later calls on the same (sequence,
    layer) then fail with FAILED_PRECONDITION: nothing applies out of order);
    the stream goes on. `await append_attend(...)` submits and waits for one.

        async with cache.stream() as s:
            futures = [await s.submit(layer, seqs, q, k, v) for ...]
            results = await asyncio.gather(*futures)
    """

    def __init__(self, cache: AsyncCache, *, timeout: Optional[float] = None):
        self.cache = cache
        super().__init__("AppendAttendStream", cache.client._kv.AppendAttendStream,
                         timeout=timeout, metadata=cache._metadata)

    async def submit(self, layer: int, sequences: Seq[Sequence], q: Any, k: Any = None,
                     v: Any = None, **options: Any) -> "asyncio.Future[AppendAttendResult]":
        """Sends one call; returns the future of its AppendAttendResult."""
        call = _AppendCall(self.cache, layer, sequences, q, k, v, **options)
        try:
            return await self._submit(call.request, call.parse, on_error=call.roll_back)
        except AttnServeError:
            call.roll_back()
            raise

    async def append_attend(self, layer: int, sequences: Seq[Sequence], q: Any, k: Any = None,
                            v: Any = None, *, return_lse: bool = False, **options: Any) -> Any:
        """One call on the stream, awaited: O, or (O, LSE) with return_lse."""
        result = await (await self.submit(layer, sequences, q, k, v, return_lse=return_lse,
                                          **options))
        return (result.o, result.lse) if return_lse else result.o

    async def __aenter__(self) -> "AsyncAppendAttendStream":
        return self
