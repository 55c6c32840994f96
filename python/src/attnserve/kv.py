"""K/V that stay on the server (attnserve.v1.KvCache): caches, sequences, append-and-attend.

    from attnserve import Client
    from attnserve.kv import Cache

    with Client("127.0.0.1:50051") as client, \\
         Cache(client, num_layers=4, num_heads_kv=2, head_dim=64, dtype="float32",
               capacity_tokens=1 << 16) as cache, \\
         cache.sequences(2) as seqs:
        for layer in range(4):                          # prefill: 2 x 7 tokens
            o = cache.append_attend(layer, seqs, q, k, v, causal=True)   # q [2, 7, Hq, D]
        ...                                             # then 1 token per step

A Cache is one model's attention geometry on one server device; a Sequence is
one token history in it (one K/V history per layer). Each step sends only the
new tokens' K/V; the server appends them to the sequences' pages and attends
the new queries over everything the sequences hold at that layer.

Ownership: closing a Cache drops it on the server (every page at once);
closing a Sequence or a Sequences group frees its sequences. Both are context
managers, so `with` frees what it made even when the body raises.

Lengths and retries: the client tracks each sequence's length per layer and
sends it as `expected_length` with every append. The server refuses a call
whose expected length is not the sequence's actual one (FAILED_PRECONDITION,
naming the actual length) and changes nothing, so an append can never be
applied twice: retrying after UNAVAILABLE (done by the channel, see
attnserve._channel) is safe. If a response was lost after the server applied
the call, the retry answers FAILED_PRECONDITION; sync() re-reads the lengths.

Affinity: every call carries the gRPC metadata header x-attnserve-cache-id
(kv.proto), so a proxy can route all calls of a cache to the replica holding it.

Moved caches: a replica draining with --handoff_peer moves its caches to the
peer and answers UNAVAILABLE "cache <id> moved to <address>" (trailing metadata
x-attnserve-moved-to). A Cache's unary calls then retry the same request (the
same expected lengths) at that address, with this client's credentials, and
send the cache's later calls there too. Streams do not follow.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import threading
import time
import uuid
from concurrent.futures import Future
from typing import (Any, Dict, Generator, Iterable, List, Optional, Sequence as Seq, Tuple,
                    Union)

import grpc
import numpy as np

from attnserve import _mods, _request, _security, _stubs, _tensors, _wire
from attnserve import shm as _shm
from attnserve._request import ServerTiming, Window
from attnserve._stream import BidiStream
from attnserve.client import Client
from attnserve.errors import AttnServeError, invalid_argument
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import kv_pb2

CACHE_ID_HEADER = "x-attnserve-cache-id"
MOVED_TO_HEADER = "x-attnserve-moved-to"
# How long a call keeps following moved-to answers before it raises.
MOVED_BUDGET_S = 60.0
_MOVED_MESSAGE = re.compile(r"^cache \S+ moved to (\S+)$")


def _moved_to(error: grpc.RpcError) -> Optional[str]:
    """The address an UNAVAILABLE moved-to answer names (the trailing metadata, or the
    message kv.proto fixes when the transport hands no metadata back); None otherwise."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    trailers = error.trailing_metadata() if callable(getattr(error, "trailing_metadata",
                                                             None)) else None
    for key, value in trailers or ():
        if key == MOVED_TO_HEADER:
            return value
    match = _MOVED_MESSAGE.match(error.details() or "")
    return match.group(1) if match else None

_DTYPES = {"float16": pb.FP16, "fp16": pb.FP16, "bfloat16": pb.BF16, "bf16": pb.BF16,
           "float32": pb.FP32, "fp32": pb.FP32}


def wire_dtype(dtype: Any) -> int:
    """attnserve.v1.DType of "bfloat16"/"float16"/"float32", a NumPy or a torch dtype."""
    if isinstance(dtype, str) or _tensors.is_torch_dtype(dtype):
        name = str(dtype).replace("torch.", "")
    else:
        name = np.dtype(dtype).name  # np.float32, ml_dtypes.bfloat16, np.dtype(...)
    if name not in _DTYPES:
        raise invalid_argument(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
    return _DTYPES[name]


@dataclasses.dataclass
class AppendAttendResult:
    """A successful append-and-attend: O (like q), LSE (FP32, only with return_lse),
    each sequence's length at the layer after the call, and what ran it."""
    o: Any
    lse: Optional[Any]
    lengths: List[int]
    timing: ServerTiming
    backend: str
    request_id: str


# One operation of the K/V API as a generator: it yields (method, request,
# timeout) for each RPC, receives the response (or the AttnServeError, thrown
# in) and returns the result. Cache runs them with blocking calls and
# attnserve.kv_aio.AsyncCache with awaited ones, so the bookkeeping (tracked
# lengths, ids, what a failure undoes) is written once for both.
Op = Generator[Tuple[str, Any, Optional[float]], Any, Any]


class CacheBase:
    """What Cache and AsyncCache share: the cache's identity, its sequences, the operations."""

    def _init(self, client: Any, num_layers: int, num_heads_kv: int, head_dim: int,
              dtype: Any, capacity_tokens: Optional[int], capacity_bytes: Optional[int],
              page_size: int, cache_id: Optional[str], device: Optional[int], reserve: bool,
              timeout: Optional[float], shm: Any = None,
              shm_tenant: str = _shm.DEFAULT_TENANT, head_dim_v: int = 0,
              v_in_k: bool = False) -> kv_pb2.CreateCacheRequest:
        self.client = client
        self.shm = shm
        self.shm_tenant = shm_tenant
        self._shm_pools: Dict[Tuple[str, str], _shm.Pool] = {}
        self.num_heads_kv = num_heads_kv
        # O's head dim: V's (MLA geometry, docs/kv-cache.md), else head_dim.
        self.head_dim_v = head_dim_v or head_dim
        self.v_in_k = bool(v_in_k)  # V read from K's rows: steps send no v
        self.cache_id = cache_id if cache_id is not None else f"py-{uuid.uuid4().hex}"
        self.timeout = timeout
        self._metadata = ((CACHE_ID_HEADER, self.cache_id),)
        self._lock = threading.Lock()
        self._next_id = itertools.count(1)
        self._sequences: Dict[int, "Sequence"] = {}
        self._closed = False
        req = kv_pb2.CreateCacheRequest(
            geometry=kv_pb2.KvGeometry(num_layers=num_layers, num_heads_kv=num_heads_kv,
                                       head_dim=head_dim, dtype=wire_dtype(dtype),
                                       head_dim_v=head_dim_v, v_in_k=v_in_k),
            page_size=page_size, capacity_tokens=capacity_tokens or 0,
            capacity_bytes=capacity_bytes or 0, cache_id=self.cache_id, reserve=reserve)
        if device is not None:
            req.device = device
        return req

    def _deadline_of(self, timeout: Optional[float]) -> Optional[float]:
        return self.client._deadline(timeout if timeout is not None else self.timeout)

    def _shm_pool(self, kind: str, like: Any) -> _shm.Pool:
        """This cache's regions of `kind` (for CUDA, on like's device)."""
        device = str(like.device) if kind == "cuda" else ""
        with self._lock:
            pool = self._shm_pools.get((kind, device))
            if pool is None:
                pool = self._shm_pools[kind, device] = _shm.Pool(
                    self.client, kind, tenant=self.shm_tenant, device=device or None)
        return pool

    def _close_shm(self) -> None:
        with self._lock:
            pools, self._shm_pools = list(self._shm_pools.values()), {}
        for pool in pools:
            pool.close()

    # -- operations ------------------------------------------------------------
    def _op_create_cache(self, req: kv_pb2.CreateCacheRequest) -> Op:
        stats = (yield "CreateCache", req, None).stats
        self.num_layers = stats.geometry.num_layers
        self.page_size = stats.page_size
        self.device = stats.device

    def _op_close(self) -> Op:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sequences.clear()
        try:
            yield "DropCache", kv_pb2.DropCacheRequest(cache_id=self.cache_id), None
        finally:
            self._close_shm()

    def _op_stats(self, timeout: Optional[float]) -> Op:
        req = kv_pb2.GetCacheStatsRequest(cache_id=self.cache_id)
        return (yield "GetCacheStats", req, timeout).stats

    def _op_server_lengths(self, sequences: Iterable["Sequence"], timeout: Optional[float]) -> Op:
        req = kv_pb2.GetCacheStatsRequest(cache_id=self.cache_id,
                                          sequence_ids=[s.id for s in sequences])
        resp = yield "GetCacheStats", req, timeout
        return {s.sequence_id: list(s.lengths) for s in resp.sequences}

    def _op_sync(self, sequences: Iterable["Sequence"], timeout: Optional[float]) -> Op:
        sequences = list(sequences)
        lengths = yield from self._op_server_lengths(sequences, timeout)
        with self._lock:
            for s in sequences:
                s._lengths = lengths[s.id]

    def _op_sequences(self, count_or_ids: Union[int, Iterable[int]],
                      timeout: Optional[float]) -> Op:
        if isinstance(count_or_ids, int):
            specs = [kv_pb2.SequenceSpec(sequence_id=self._id(None)) for _ in range(count_or_ids)]
        else:
            specs = [kv_pb2.SequenceSpec(sequence_id=int(i)) for i in count_or_ids]
        return Sequences(self, (yield from self._op_create(specs, timeout)))

    def _op_fork(self, source: "Sequence", length: Optional[int], count: int,
                 timeout: Optional[float]) -> Op:
        spec = dict(fork_from=source.id)
        if length is not None:
            spec["fork_length"] = length
        specs = [kv_pb2.SequenceSpec(sequence_id=self._id(None), **spec) for _ in range(count)]
        return Sequences(self, (yield from self._op_create(specs, timeout)))

    def _op_fork_one(self, source: "Sequence", length: Optional[int],
                     timeout: Optional[float]) -> Op:
        return (yield from self._op_fork(source, length, 1, timeout))[0]

    def _id(self, wanted: Optional[int]) -> int:
        if wanted is not None:
            return int(wanted)
        with self._lock:
            while True:
                candidate = next(self._next_id)
                if candidate not in self._sequences:
                    return candidate

    def _op_create(self, specs: List[kv_pb2.SequenceSpec], timeout: Optional[float]) -> Op:
        req = kv_pb2.CreateSequencesRequest(cache_id=self.cache_id, sequences=specs)
        yield "CreateSequences", req, timeout
        made = []
        with self._lock:
            for spec in specs:
                if spec.HasField("fork_from"):
                    source = self._sequences.get(spec.fork_from)
                    lengths = list(source._lengths) if source else None
                    if lengths is not None and spec.HasField("fork_length"):
                        lengths = [min(n, spec.fork_length) for n in lengths]
                else:
                    lengths = [0] * self.num_layers
                seq = Sequence(self, spec.sequence_id, lengths)
                self._sequences[seq.id] = seq
                made.append(seq)
        unknown = [s for s in made if s._lengths is None]  # forked from a sequence not ours
        if unknown:
            yield from self._op_sync(unknown, timeout)
        return made

    def _op_free(self, sequences: Iterable["Sequence"], timeout: Optional[float]) -> Op:
        live = [s for s in sequences if not s._freed]
        if not live or self._closed:
            return
        yield "FreeSequences", kv_pb2.FreeSequencesRequest(
            cache_id=self.cache_id, sequence_ids=[s.id for s in live]), timeout
        with self._lock:
            for s in live:
                s._freed = True
                self._sequences.pop(s.id, None)

    def _op_truncate(self, seq: "Sequence", length: int, layer: Optional[int],
                     timeout: Optional[float]) -> Op:
        req = kv_pb2.TruncateRequest(cache_id=self.cache_id, sequence_id=seq.id, length=length)
        if layer is not None:
            req.layer = layer
        stats = (yield "Truncate", req, timeout).stats
        with self._lock:
            for i in range(len(seq._lengths)) if layer is None else [layer]:
                seq._lengths[i] = length
        return stats

    def _op_append_attend(self, layer: int, sequences: Seq["Sequence"], q: Any, k: Any, v: Any,
                          timeout: Optional[float], options: Dict[str, Any]) -> Op:
        call = _AppendCall(self, layer, sequences, q, k, v, **options)
        try:
            resp = yield "AppendAttend", call.request, timeout
        except BaseException:
            call.roll_back()
            raise
        return call.parse(resp)


class Cache(CacheBase):
    """One attnserve K/V cache (CreateCache on construction, DropCache on close()).

    Args:
      client: the attnserve.Client whose channel the calls use.
      num_layers, num_heads_kv, head_dim, dtype: the geometry (KvGeometry);
        dtype is that of K, V, Q and O ("bfloat16", "float16", "float32", or a
        NumPy/torch dtype).
      capacity_tokens / capacity_bytes: exactly one: the cache's maximum size
        (tokens over all sequences and layers, or K+V bytes). A maximum, not a
        reservation unless `reserve`.
      page_size: tokens per page (a power of two in [16, 256]); 0 = the server's.
      cache_id: the cache's name; None = a fresh random one chosen here (so the
        affinity header is known from the first call on).
      device: the server device; None = the one with the most free K/V budget.
      reserve: take the whole capacity from the device's budget now.
      timeout: default deadline of this cache's calls (None = the client's).
      shm: same-host shared memory for the append-and-attend calls' q, k, v and O
        (attnserve.shm; the server must run with --allow_client_shm): None/False (in
        the messages), True (CUDA IPC for CUDA torch tensors when the server's backend
        is CUDA, else a POSIX shm object), "system" or "cuda"; each call's shm= overrides.
      shm_tenant: the tenant whose key prefix system regions take ("/attnserve.<tenant>.";
        the server's tenant of this client's token, "default" without tokens).
      head_dim_v, v_in_k: MLA geometry (docs/kv-cache.md, "MLA caches"): V's head dim
        when it differs from head_dim (0 = head_dim; O has it too), and V as the first
        head_dim_v elements of each K row (pages hold K alone; steps send no v).
    """

    def __init__(self, client: Client, *, num_layers: int, num_heads_kv: int, head_dim: int,
                 dtype: Any, capacity_tokens: Optional[int] = None,
                 capacity_bytes: Optional[int] = None, page_size: int = 0,
                 cache_id: Optional[str] = None, device: Optional[int] = None,
                 reserve: bool = False, timeout: Optional[float] = None, shm: Any = None,
                 shm_tenant: str = _shm.DEFAULT_TENANT, head_dim_v: int = 0,
                 v_in_k: bool = False):
        req = self._init(client, num_layers, num_heads_kv, head_dim, dtype, capacity_tokens,
                         capacity_bytes, page_size, cache_id, device, reserve, timeout, shm,
                         shm_tenant, head_dim_v, v_in_k)
        self._run(self._op_create_cache(req))

    def _call(self, method: str, request: Any, timeout: Optional[float] = None) -> Any:
        give_up = time.monotonic() + MOVED_BUDGET_S
        while True:
            stub = getattr(self, "_moved_stub", None) or self.client._kv
            try:
                return getattr(stub, method)(request, timeout=self._deadline_of(timeout),
                                             metadata=self._metadata)
            except grpc.RpcError as e:
                address = _moved_to(e)
                if address is None or time.monotonic() > give_up:
                    raise AttnServeError.from_rpc_error(e) from None
                self._follow(address)

    def _follow(self, address: str) -> None:
        """The cache's calls go to `address` from now on, with this client's credentials."""
        _, opts, credentials, token = self.client._channel_args
        if credentials is not None:
            channel = grpc.secure_channel(address, credentials, opts)
        elif token:
            channel = grpc.intercept_channel(grpc.insecure_channel(address, opts),
                                             _security.BearerInterceptor(token))
        else:
            channel = grpc.insecure_channel(address, opts)
        self._moved_stub = _stubs.KvCacheStub(channel, None)

    def _run(self, op: Op) -> Any:
        """Runs an operation's RPCs one after another (see Op)."""
        try:
            step = next(op)
            while True:
                try:
                    resp = self._call(*step)
                except AttnServeError as e:
                    step = op.throw(e)
                else:
                    step = op.send(resp)
        except StopIteration as done:
            return done.value

    _go = _run  # how Sequence runs its operations on this cache

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Drops the cache on the server (all its sequences and pages); idempotent."""
        self._run(self._op_close())

    drop = close

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- statistics ----------------------------------------------------------
    def stats(self, *, timeout: Optional[float] = None) -> kv_pb2.CacheStats:
        """GetCacheStats: pages used/free, live sequences, tokens, ..."""
        return self._run(self._op_stats(timeout))

    def server_lengths(self, sequences: Iterable["Sequence"], *,
                       timeout: Optional[float] = None) -> Dict[int, List[int]]:
        """Each sequence's per-layer lengths as the server has them, by sequence id."""
        return self._run(self._op_server_lengths(sequences, timeout))

    def sync(self, sequences: Iterable["Sequence"], *, timeout: Optional[float] = None) -> None:
        """Re-reads the sequences' lengths from the server (after a failed or lost call)."""
        self._run(self._op_sync(sequences, timeout))

    # -- sequences -----------------------------------------------------------
    def sequence(self, sequence_id: Optional[int] = None, *,
                 timeout: Optional[float] = None) -> "Sequence":
        """One new empty sequence (close it, or use it as a context manager)."""
        ids = 1 if sequence_id is None else [sequence_id]
        return self._run(self._op_sequences(ids, timeout))[0]

    def sequences(self, count_or_ids: Union[int, Iterable[int]], *,
                  timeout: Optional[float] = None) -> "Sequences":
        """New empty sequences, all or none: a count (ids chosen here) or explicit ids."""
        return self._run(self._op_sequences(count_or_ids, timeout))

    def fork(self, source: "Sequence", length: Optional[int] = None, *, count: int = 1,
             timeout: Optional[float] = None) -> "Sequences":
        """`count` new sequences starting as the first `length` tokens of `source`
        (None: its whole length, which must be the same at every layer). They
        share the prefix's pages on the server (a partial last page copy-on-write)."""
        return self._run(self._op_fork(source, length, count, timeout))

    def truncate(self, sequence: "Sequence", length: int, layer: Optional[int] = None, *,
                 timeout: Optional[float] = None) -> kv_pb2.CacheStats:
        """Cuts `sequence` to `length` tokens at `layer` (None: every layer), e.g. to
        roll back rejected speculative tokens; pages past it return to the pool."""
        return self._run(self._op_truncate(sequence, length, layer, timeout))

    def free(self, sequences: Iterable["Sequence"], *, timeout: Optional[float] = None) -> None:
        """Frees sequences on the server, all or none (FreeSequences); their pages
        not shared with another sequence return to the pool. Idempotent."""
        self._run(self._op_free(sequences, timeout))

    # -- append and attend ---------------------------------------------------
    def append_attend(self, layer: int, sequences: Seq["Sequence"], q: Any, k: Any = None,
                      v: Any = None, *, causal: bool = True, window: Window = None,
                      softcap: float = 0.0, scale: Optional[float] = None,
                      return_lse: bool = False, cu_seqlens_q: Any = None,
                      cu_seqlens_k: Any = None, alibi_slopes: Any = None, sinks: Any = None,
                      bias: Any = None, mask: Any = None, attend_pages: Any = None,
                      timeout: Optional[float] = None, shm: Any = None) -> Any:
        """Appends the new tokens' K/V to each sequence at `layer`, then attends the
        new queries over everything the sequence holds there. Returns O like q,
        or (O, LSE) with return_lse.

        Layout (the rows of the sequences in the order given):
          dense: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], B = len(sequences): Sq
            queries and Sk new tokens for each sequence;
          packed: q [Tq, Hq, D], k/v [Tk, Hkv, D], split by cu_seqlens_q/k
            (B+1 offsets; not needed for one sequence).
          k = v = None: attend only (no new tokens); q = None: append only.
        causal (the default here) is bottom-right against each sequence's length
        after the append: the new tokens see the prefix and the causal part of
        themselves. window, softcap, scale as Client.forward.

        Score modifiers (docs/masks.md), NumPy or torch, [Hq] each:
          alibi_slopes: ALiBi, minus slope[h] * |i - j| with i and j positions in the
            whole sequence (the queries are its last positions);
          sinks: one logit per head joining each row's softmax denominator (gpt-oss).
        bias (float32/float16/bfloat16) and mask (bool, True = attend): each sequence's
          queries over its whole history after the append (key j = its token j), added /
          applied after scale and softcap as in forward(); [Hq or 1, P] packed, each
          sequence's [num_queries, length after the append] block one after another (P the
          sum of those sizes), or [B or 1, Hq or 1, Sq, L] when every sequence has Sq
          queries and L tokens after the append. Not with attend_pages.
        attend_pages: page-level sparsity, one entry per sequence: None (all of its
          history), or the pages of its history to attend (page p holds tokens
          [p * page_size, (p + 1) * page_size) of the sequence's tokens before this
          call; strictly increasing); the pages of the new tokens are always
          attended. Not with alibi_slopes or a window; with causal, at most one query
          more than new tokens per sequence (docs/kv-cache.md).

        shm: q, k, v and O through same-host shared memory instead of the message
          (the Cache's shm argument says what True means; None: the Cache's default).
          q, k and v are copied into a region of this cache's pool and O is read back
          from it (a copy, like q's kind and device); LSE comes in the response.

        Safe to retry after UNAVAILABLE: the call carries each sequence's
        expected length, so the server never appends twice (see the module doc).
        On failure nothing changed on the server and the tracked lengths stay.

        Raises:
          AttnServeError: FAILED_PRECONDITION (a length differs from the server's:
            the message names the actual one; sync() re-reads them), NOT_FOUND
            (cache or sequence gone: re-create and re-prefill), INVALID_ARGUMENT
            (naming the field), RESOURCE_EXHAUSTED (pages needed and free).
        """
        result = self.append_attend_result(
            layer, sequences, q, k, v, causal=causal, window=window, softcap=softcap,
            scale=scale, return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes, sinks=sinks, bias=bias,
            mask=mask, attend_pages=attend_pages, timeout=timeout, shm=shm)
        return (result.o, result.lse) if return_lse else result.o

    def append_attend_result(self, layer: int, sequences: Seq["Sequence"], q: Any, k: Any = None,
                             v: Any = None, *, timeout: Optional[float] = None,
                             **options: Any) -> AppendAttendResult:
        """append_attend(), returning an AppendAttendResult (O, LSE, lengths, timing)."""
        return self._run(self._op_append_attend(layer, sequences, q, k, v, timeout, options))

    def stream(self, *, timeout: Optional[float] = None,
               follow_moves: bool = True) -> "AppendAttendStream":
        """An AppendAttendStream on this cache (close it, or use it as a context manager).
        follow_moves: reopen it where the cache moved (see AppendAttendStream)."""
        return AppendAttendStream(self, timeout=timeout, follow_moves=follow_moves)

    # -- moving it ---------------------------------------------------------------
    def export_to(self, dest: Any, *, cache_id: Optional[str] = None,
                  sequences: Optional[Iterable["Sequence"]] = None, **options: Any) -> Any:
        """Copies this cache's sequences (all, or `sequences`) elsewhere; the cache keeps
        them. `dest` a Client: attnserve.transfer.move_cache into `cache_id` (default
        this cache's id; capacity_tokens=... lets the receiver create it), returning its
        TransferResult. `dest` a path: a snapshot file (attnserve.transfer.export_file),
        returning the number of chunks. `options` are those functions' arguments."""
        from attnserve import transfer
        ids = None if sequences is None else [s.id for s in sequences]
        if isinstance(dest, (str, os.PathLike)):
            return transfer.export_file(self.client, self.cache_id, os.fspath(dest),
                                        sequence_ids=ids, **options)
        return transfer.move_cache(self.client, dest, self.cache_id, dest_cache_id=cache_id,
                                   sequence_ids=ids, **options)


class _FreedOnExit:
    """`with` / `async with` (for an AsyncCache's) that free() on the way out."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.free()


class Sequence(_FreedOnExit):
    """One sequence of a Cache: its id and its length at each layer as tracked here.

    Made by Cache.sequence()/sequences()/fork(); close() (or free()) frees it on
    the server. `lengths` is the client's view: what the next append expects.
    """

    def __init__(self, cache: CacheBase, sequence_id: int, lengths: Optional[List[int]]):
        self.cache = cache
        self.id = sequence_id
        self._lengths = lengths
        self._freed = False

    @property
    def lengths(self) -> List[int]:
        """The sequence's length at each layer (a copy)."""
        return list(self._lengths or [])

    def length(self, layer: int = 0) -> int:
        return self._lengths[layer]

    # Each method runs through the cache's driver: a value for a Cache, an
    # awaitable for an AsyncCache (then `await seq.truncate(...)`, `async with`).
    def fork(self, length: Optional[int] = None, *, timeout: Optional[float] = None) -> "Sequence":
        """A new sequence starting as this one's first `length` tokens (see Cache.fork)."""
        return self.cache._go(self.cache._op_fork_one(self, length, timeout))

    def truncate(self, length: int, layer: Optional[int] = None, *,
                 timeout: Optional[float] = None) -> kv_pb2.CacheStats:
        """Cuts the sequence to `length` tokens at `layer` (None: every layer), e.g.
        to roll back rejected speculative tokens; pages past it return to the pool."""
        return self.cache._go(self.cache._op_truncate(self, length, layer, timeout))

    def free(self, *, timeout: Optional[float] = None) -> None:
        """Frees the sequence on the server; idempotent."""
        return self.cache._go(self.cache._op_free([self], timeout))

    close = free

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, lengths={self._lengths})"


class Sequences(_FreedOnExit, list):
    """A list of Sequences that frees them all in one call when closed."""

    def __init__(self, cache: CacheBase, items: Iterable[Sequence]):
        super().__init__(items)
        self.cache = cache

    def free(self, *, timeout: Optional[float] = None) -> None:
        return self.cache._go(self.cache._op_free(self, timeout))

    close = free


class _AppendCall:
    """One AppendAttend request: built from the arguments, the sequences' tracked
    lengths advanced at once (so calls pipelined on a stream expect the right
    lengths), and undone when the call fails."""

    def __init__(self, cache: CacheBase, layer: int, sequences: Seq[Sequence], q: Any, k: Any,
                 v: Any, *, causal: bool = True, window: Window = None, softcap: float = 0.0,
                 scale: Optional[float] = None, return_lse: bool = False,
                 cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                 alibi_slopes: Any = None, sinks: Any = None, attend_pages: Any = None,
                 request_id: Optional[str] = None, shm: Any = None, bias: Any = None,
                 mask: Any = None):
        if not 0 <= layer < cache.num_layers:
            raise invalid_argument(f"layer: expected in [0, {cache.num_layers}), got {layer}")
        if cache.v_in_k and v is not None:
            raise invalid_argument("v: expected None on a v_in_k cache (V is the first "
                                   "head_dim_v elements of each k row)")
        if (k is None) != (v is None) and not cache.v_in_k:
            raise invalid_argument("k, v: give both (append) or neither (attend only)")
        self.cache = cache
        self.layer = layer
        self.sequences = list(sequences)
        self.like = q if q is not None else k
        self.lease: Optional[_shm.Lease] = None
        shm_kind = _shm.kind_for(cache.client, cache.shm if shm is None else shm, self.like)
        # O is shaped like q with V's head dim (MLA geometry: not q's).
        self.q_shape = None if q is None else tuple(q.shape)[:-1] + (cache.head_dim_v,)
        batch = len(self.sequences)
        q, nq = _packed("q", q, "cu_seqlens_q", cu_seqlens_q, batch)
        k, nk = _packed("k", k, "cu_seqlens_k", cu_seqlens_k, batch)
        v, _ = _packed("v", v, "cu_seqlens_k", cu_seqlens_k, batch)
        req = kv_pb2.AppendAttendRequest(request_id=request_id or _request.next_request_id(),
                                         cache_id=cache.cache_id, layer=layer)
        if shm_kind is None:
            tensors = [(name, None if x is None else _tensors.to_out(name, x))
                       for name, x in (("q", q), ("k", k), ("v", v))]
        _request.fill_options(req.options, causal=causal, window=window, softcap=softcap,
                              scale=scale, return_lse=return_lse)
        heads = None if q is None else int(q.shape[1])
        _mods.apply_kv(req.options, heads, cache.num_heads_kv, alibi_slopes=alibi_slopes,
                       sinks=sinks)
        pages = _mods.attend_pages_of(attend_pages, batch)
        if any(pages):
            _check_sparse(req.options, pages, nq, nk)
        if bias is not None or mask is not None:  # over each history after the append
            if any(pages):
                raise invalid_argument("bias, mask: not with attend_pages (their rows span "
                                       "each sequence's whole history)")
            after = [(s._lengths[layer] if s._lengths is not None else 0) + n
                     for s, n in zip(self.sequences, nk)]
            pieces = _mods.kv_pair_tensors(heads, nq, after, bias=bias, mask=mask)
        else:
            pieces = []
        if shm_kind is not None:  # last before the lengths advance: released if they cannot
            tensors = []
            self.lease = _shm_inputs(cache, shm_kind, req, (("q", q), ("k", k), ("v", v)))
        self.after: List[int] = []
        try:
            self._advance(cache, req, layer, pages, nq, nk)
        except BaseException:
            self._release()
            raise
        self.steps = req.sequences
        # Encoded last: nothing raises after the lengths advanced above.
        self.request = _wire.encode(req, tensors + pieces)

    def _advance(self, cache: CacheBase, req: kv_pb2.AppendAttendRequest, layer: int,
                 pages: List[Any], nq: List[int], nk: List[int]) -> None:
        """The call's steps, each sequence's tracked length advanced by its new tokens."""
        with cache._lock:
            for i, s in enumerate(self.sequences):
                if s._freed:
                    raise invalid_argument(f"sequences[{i}]: sequence {s.id} was freed")
                if s.cache is not cache:
                    raise invalid_argument(f"sequences[{i}]: sequence {s.id} belongs to "
                                           f"cache {s.cache.cache_id}, not {cache.cache_id}")
                if pages[i]:
                    _mods.check_pages(i, pages[i], s.id, s._lengths[layer], cache.page_size)
            for s, n_q, n_new, p in zip(self.sequences, nq, nk, pages):
                expected = s._lengths[layer]
                req.sequences.add(sequence_id=s.id, expected_length=expected,
                                  num_new_tokens=n_new, num_queries=n_q,
                                  attend_pages=p or ())
                s._lengths[layer] = expected + n_new
                self.after.append(expected + n_new)

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def roll_back(self) -> None:
        """Undoes this call's advance of each tracked length, unless a later call
        on the same (sequence, layer) moved it on (that one rolls back itself)."""
        self._release()
        with self.cache._lock:
            for s, step, after in zip(self.sequences, self.steps, self.after):
                if s._lengths is not None and s._lengths[self.layer] == after:
                    s._lengths[self.layer] = step.expected_length

    def parse(self, received: _wire.Received) -> AppendAttendResult:
        try:
            return self._parse(received)
        finally:
            self._release()

    def _parse(self, received: _wire.Received) -> AppendAttendResult:
        resp: kv_pb2.AppendAttendResponse = received.message  # all but o and lse
        if resp.error_code != 0:
            raise AttnServeError.from_code_number(resp.error_code, resp.error_message,
                                                  resp.request_id)
        o = lse = None
        if self.q_shape is not None:
            o, lse = _request.outputs_of(received, self.like, self.lease)
            o = o.reshape(self.q_shape)
        return AppendAttendResult(o=o, lse=lse, lengths=list(resp.lengths),
                                  timing=_request.server_timing(resp.timing),
                                  backend=resp.backend, request_id=resp.request_id)


def _shm_inputs(cache: CacheBase, kind: str, req: kv_pb2.AppendAttendRequest,
                inputs: Iterable[Tuple[str, Any]]) -> _shm.Lease:
    """q, k and v copied into a region of the cache's pool, the request naming their spans
    (Tensor.shm, no data) and O's (output_shm.o); the lease holds the region."""
    like = next(x for _, x in inputs if x is not None)
    named = []
    for name, x in inputs:
        if x is None:
            continue
        if kind == "cuda":
            wire = _tensors._torch_wire_dtypes().get(x.dtype)
            if wire is None or not _tensors.is_torch(x) or x.device.type != "cuda":
                raise invalid_argument(f"{name}: shm \"cuda\" needs CUDA torch tensors of "
                                       f"float16, bfloat16 or float32, got {type(x).__name__} "
                                       f"{getattr(x, 'dtype', '')}")
            named.append((name, wire, tuple(x.shape), x))
        else:
            out = _tensors.to_out(name, x)
            named.append((name, out.dtype, out.shape, out.data))
    o_bytes = _shm.nbytes(named[0][3]) if named[0][0] == "q" else 0
    if o_bytes and named[0][2][-1]:  # O has V's head dim
        o_bytes = o_bytes // named[0][2][-1] * cache.head_dim_v
    lease = _shm.Lease(cache._shm_pool(kind, like), [(n, p) for n, _, _, p in named], o_bytes)
    for name, wire, shape, _ in named:
        t = getattr(req, name)
        t.dtype = wire
        t.shape.extend(shape)
        t.shm.CopyFrom(lease.spans[name])
    if lease.o is not None:
        req.output_shm.o.CopyFrom(lease.o)
    return lease


def _check_sparse(opts: pb.AttentionOptions, pages: List[Optional[List[int]]],
                  nq: List[int], nk: List[int]) -> None:
    """What attend_pages cannot go with (docs/kv-cache.md): ALiBi and windows count
    positions, which the pages left out would shift; causal needs every query but the
    first to have a new token of its own."""
    first = next(i for i, p in enumerate(pages) if p)
    if opts.alibi_slopes:
        raise invalid_argument(f"attend_pages[{first}]: not supported with alibi_slopes "
                               "(ALiBi's distances count positions in the whole sequence)")
    for side in ("window_left", "window_right"):
        if opts.HasField(side):
            raise invalid_argument(f"attend_pages[{first}]: not supported with a window "
                                   f"(window sets {side} = {getattr(opts, side)}; a window "
                                   "counts positions, and attend_pages leaves pages out)")
    if opts.causal:
        for i, p in enumerate(pages):
            if p and nq[i] > nk[i] + 1:
                raise invalid_argument(
                    f"attend_pages[{i}]: with causal, expected at most the new tokens + 1 = "
                    f"{nk[i] + 1} queries for sequence {i} (queries past the new tokens would "
                    f"see pages left out), got {nq[i]}")


def _packed(name: str, x: Any, cu_name: str, cu_seqlens: Any,
            batch: int) -> Tuple[Any, List[int]]:
    """x in the packed layout [T, H, D] and its rows per sequence."""
    if x is None:
        return None, [0] * batch
    if x.ndim == 4:  # dense [B, S, H, D]
        if x.shape[0] != batch:
            raise invalid_argument(f"{name}.shape[0]: expected {batch} (one row per sequence), "
                                   f"got {x.shape[0]}")
        return x.reshape(batch * x.shape[1], *x.shape[2:]), [int(x.shape[1])] * batch
    if x.ndim != 3:
        raise invalid_argument(f"{name}: expected [B, S, H, D] or packed [T, H, D], got shape "
                               f"{tuple(x.shape)}")
    offsets = _tensors.to_offsets(cu_name, cu_seqlens)
    if offsets is None:
        if batch != 1:
            raise invalid_argument(f"{cu_name}: required for a packed {name} of {batch} "
                                   "sequences")
        return x, [int(x.shape[0])]
    if len(offsets) != batch + 1 or offsets[0] != 0 or offsets[-1] != x.shape[0] or any(
            b < a for a, b in zip(offsets, offsets[1:])):
        raise invalid_argument(f"{cu_name}: expected {batch + 1} non-decreasing "
                               f"offsets from 0 to {x.shape[0]}, got {offsets}")
    return x, [b - a for a, b in zip(offsets, offsets[1:])]


class AppendAttendStream(BidiStream):
    """A generation loop on one AppendAttendStream RPC: many calls in flight.

    submit() takes append_attend()'s arguments and returns a
    concurrent.futures.Future of its AppendAttendResult at once. Calls on the
    same (sequence, layer) apply in submission order on the server, and each
    expects the length the previous one leaves, so a decode step's layers can
    be pipelined. A failed call fails only its own future (later calls on the
    same (sequence, layer) then fail with FAILED_PRECONDITION: nothing is
    applied out of order); the stream goes on.

    A moved cache (--handoff_peer): the replica ends the stream UNAVAILABLE
    moved-to once it has answered the calls it had started; it applied none of
    the others. With follow_moves (the default) the stream reopens at that
    address and sends the unanswered calls again in their order, so each future
    resolves once; each call's bytes are copied at submit() to that end.

        with cache.stream() as s:
            futures = [s.submit(layer, seqs, q[layer], k[layer], v[layer]) for layer in ...]
            outs = [f.result().o for f in futures]
    """

    def __init__(self, cache: Cache, *, timeout: Optional[float] = None,
                 follow_moves: bool = True):
        self.cache = cache

        def reopen(address: str) -> Any:
            cache._follow(address)
            return cache._moved_stub.AppendAttendStream

        stub = getattr(cache, "_moved_stub", None) or cache.client._kv
        super().__init__("AppendAttendStream", stub.AppendAttendStream, timeout=timeout,
                         metadata=cache._metadata, reopen=reopen if follow_moves else None,
                         moved_to=_moved_to, reopen_budget_s=MOVED_BUDGET_S)

    def submit(self, layer: int, sequences: Seq[Sequence], q: Any, k: Any = None, v: Any = None,
               **options: Any) -> "Future[AppendAttendResult]":
        """Sends one call (append_attend()'s arguments); returns the future of its result."""
        call = _AppendCall(self.cache, layer, sequences, q, k, v, **options)
        try:
            return self._submit(call.request, call.parse, on_error=call.roll_back)
        except AttnServeError:
            call.roll_back()
            raise

    def __enter__(self) -> "AppendAttendStream":
        return self
