"""attnserve.kv for asyncio: AsyncCache, the same operations as coroutines on an AsyncClient.

    async with AsyncClient(target) as client:
        cache = await AsyncCache.create(client, num_layers=4, num_heads_kv=2, head_dim=64,
                                        dtype="float32", capacity_tokens=1 << 16)
        async with cache, await cache.sequences(2) as seqs:
            o = await cache.append_attend(0, seqs, q, k, v)
            await seqs[0].truncate(3)

Sequences of an AsyncCache are the same Sequence/Sequences objects: their
fork(), truncate() and free() return awaitables, and they are `async with`
context managers. The operations, their bookkeeping and the retry rule are
attnserve.kv's (CacheBase); only the calls are awaited here. Many calls in
flight: asyncio.gather of append_attend() calls on different (sequence,
layer) pairs; calls on the same pair must be awaited in order (a unary call
may overtake another on the wire; the stream form orders them, see
attnserve.kv.AppendAttendStream).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence as Seq, Union

import grpc

from attnserve.aio import AsyncClient
from attnserve.errors import AttnServeError
from attnserve.kv import AppendAttendResult, CacheBase, Op, Sequence, Sequences
from attnserve.v1 import kv_pb2


class AsyncCache(CacheBase):
    """attnserve.kv.Cache for asyncio; make one with `await AsyncCache.create(...)`
    (Cache's arguments), drop it with `await close()` or `async with`."""

    @classmethod
    async def create(cls, client: AsyncClient, *, num_layers: int, num_heads_kv: int,
                     head_dim: int, dtype: Any, capacity_tokens: Optional[int] = None,
                     capacity_bytes: Optional[int] = None, page_size: int = 0,
                     cache_id: Optional[str] = None, device: Optional[int] = None,
                     reserve: bool = False, timeout: Optional[float] = None) -> "AsyncCache":
        self = cls()
        req = self._init(client, num_layers, num_heads_kv, head_dim, dtype, capacity_tokens,
                         capacity_bytes, page_size, cache_id, device, reserve, timeout)
        await self._run(self._op_create_cache(req))
        return self

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

    _go = _run  # Sequence's methods return these coroutines

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

    async def sequence(self, sequence_id: Optional[int] = None, *,
                       timeout: Optional[float] = None) -> Sequence:
        ids = 1 if sequence_id is None else [sequence_id]
        return (await self._run(self._op_sequences(ids, timeout)))[0]

    async def sequences(self, count_or_ids: Union[int, Iterable[int]], *,
                        timeout: Optional[float] = None) -> Sequences:
        return await self._run(self._op_sequences(count_or_ids, timeout))

    async def fork(self, source: Sequence, length: Optional[int] = None, *, count: int = 1,
                   timeout: Optional[float] = None) -> Sequences:
        return await self._run(self._op_fork(source, length, count, timeout))

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
