"""Moving K/V sequences between servers (attnserve.v1.KvTransfer, docs/kv-transfer.md).

    from attnserve import Client
    from attnserve.transfer import move_cache

    with Client("10.0.0.1:50051") as a, Client("10.0.0.2:50051") as b:
        r = move_cache(a, b, "kv0", capacity_tokens=1 << 20)   # b creates "kv0" if it lacks it
        print(r.sequences, r.bytes, r.resumes)

A cache's sequences leave one server as a stream of chunks (export_sequences)
and enter another, or the same one, as live sequences with the same ids and
lengths (import_sequences), all or nothing per sequence. move_cache pipes the
one into the other; when either stream breaks it opens the import again with
the same transfer id, reads where the receiver stands (the first answer) and
restarts the export from there, so finished sequences are not sent again (the
C++ client's MoveCache/PushChunks, client/kv_transfer.h, do the same).

Snapshots: write_chunks(path, export_sequences(...)) (or export_file) keeps an
export on disk in the format `attnctl export-kv` writes (each KvChunk preceded
by its length as a varint); import_file(client, path, cache_id) sends it back,
resuming a cut stream by skipping what the receiver holds.

Deadlines: a transfer of gigabytes outlives the client's per-call timeout, so
these calls have none unless given `timeout` (seconds, for each stream).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence

import grpc

from attnserve._crc32c import FAST as _crc_fast
from attnserve._crc32c import crc32c
from attnserve.errors import AttnServeError, invalid_argument
from attnserve.v1 import kv_pb2
from attnserve.v1 import kv_transfer_pb2 as pb
from attnserve.v1 import kv_transfer_pb2_grpc as pb_grpc

CACHE_ID_HEADER = "x-attnserve-cache-id"
DEFAULT_MAX_RESUMES = 8
# Breaks a resumed stream may get past: a cut connection, a drained server, a chunk
# damaged on the way (DATA_LOSS: not kept, sent again), a half-closed import.
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED})

# progress(bytes_sent, total_bytes, sequences_live): after each chunk sent.
Progress = Callable[[int, int, int], None]
# open_chunks(resume, transfer_id) -> the chunks from that resume point (None: from the
# start), the first with the header carrying transfer_id.
OpenChunks = Callable[[Optional[pb.ImportResumePoint], str], Iterable[pb.KvChunk]]


@dataclasses.dataclass
class TransferResult:
    """A finished transfer: what went over the wire and where the receiver stands."""
    transfer_id: str
    bytes: int                # payload bytes sent to the import (resent ones included)
    bytes_resent: int         # of those, chunks sent again after a cut
    sequence_ids: List[int]   # sequences live on the receiver from this transfer
    resumes: int              # broken streams resumed
    seconds: float
    stats: kv_pb2.CacheStats  # the receiving cache after the last chunk

    @property
    def sequences(self) -> int:
        return len(self.sequence_ids)


def payload_bytes(chunk: pb.KvChunk) -> int:
    return len(chunk.k) + len(chunk.v) + len(chunk.k_scale) + len(chunk.v_scale)


def chunk_crc32c(chunk: pb.KvChunk) -> int:
    """CRC-32C of k, v, k_scale, v_scale as one byte string (KvChunk.crc32c)."""
    crc = 0
    for part in (chunk.k, chunk.v, chunk.k_scale, chunk.v_scale):
        crc = crc32c(part, crc)
    return crc


def _stub(client: Any) -> pb_grpc.KvTransferStub:
    return pb_grpc.KvTransferStub(client._sync_channel())


def _error(e: grpc.RpcError, where: str) -> AttnServeError:
    err = AttnServeError.from_rpc_error(e)
    return AttnServeError(err.code, f"{where}: {err.message}")


def _create_request(capacity_tokens: Optional[int], capacity_bytes: Optional[int],
                    device: Optional[int], reserve: bool) -> Optional[kv_pb2.CreateCacheRequest]:
    if not capacity_tokens and not capacity_bytes:
        if device is not None or reserve:
            raise invalid_argument("device, reserve: describe a cache the receiver creates; "
                                   "give capacity_tokens or capacity_bytes too")
        return None
    if bool(capacity_tokens) == bool(capacity_bytes):
        raise invalid_argument(f"capacity_tokens, capacity_bytes: give exactly one, got "
                               f"{capacity_tokens} and {capacity_bytes}")
    req = kv_pb2.CreateCacheRequest(capacity_tokens=capacity_tokens or 0,
                                    capacity_bytes=capacity_bytes or 0, reserve=reserve)
    if device is not None:
        req.device = device
    return req


class ChunkStream:
    """One ExportSequences stream: iterate it for its KvChunks (the first carries the
    header); cancel() ends it early. A failed stream raises AttnServeError."""

    def __init__(self, call: Any):
        self._call = call

    def __iter__(self) -> "ChunkStream":
        return self

    def __next__(self) -> pb.KvChunk:
        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise _error(e, "ExportSequences") from None

    def cancel(self) -> None:
        self._call.cancel()


def export_sequences(client: Any, cache_id: str, *, sequence_ids: Optional[Sequence[int]] = None,
                     token_begin: int = 0, token_end: Optional[int] = None,
                     max_chunk_bytes: int = 0, transfer_id: Optional[str] = None,
                     resume: Optional[pb.ImportResumePoint] = None,
                     timeout: Optional[float] = None) -> ChunkStream:
    """The chunks of `cache_id`'s sequences on `client`'s server (ExportSequences).

    Args:
      sequence_ids: the sequences, in sending order (None: every live one, ascending).
      token_begin, token_end: each layer's rows [token_begin, token_end) (None: the
        whole length); token_begin > 0 is a range an import appends to sequences
        already holding token_begin tokens.
      max_chunk_bytes: payload per chunk, rounded down to whole pages (0: 4 MiB).
      transfer_id: the header's id (None: the server makes one).
      resume: where a receiver stands (an ImportSequencesResponse.resume): skip what
        it holds.
    """
    req = pb.ExportSequencesRequest(cache_id=cache_id, sequence_ids=sequence_ids or (),
                                    token_begin=token_begin, max_chunk_bytes=max_chunk_bytes,
                                    transfer_id=transfer_id or "")
    if token_end is not None:
        req.token_end = token_end
    if resume is not None:
        req.resume.CopyFrom(resume)
    return ChunkStream(_stub(client).ExportSequences(req, timeout=timeout,
                                                      metadata=((CACHE_ID_HEADER, cache_id),)))


def _resume_is_empty(point: pb.ImportResumePoint) -> bool:
    return not point.committed_sequence_ids and not point.HasField("sequence_id")


class _Attempt:
    """One ImportSequences stream: the header first, then (once the receiver said where
    it stands) the chunks from there; answers are read on the caller's thread."""

    def __init__(self, cache_id: str, create: Optional[kv_pb2.CreateCacheRequest],
                 header: pb.KvTransferHeader, source: Optional[Iterable[pb.KvChunk]],
                 pending: List[pb.KvChunk], open_chunks: OpenChunks,
                 on_chunk: Callable[[pb.KvChunk], None]):
        self.cache_id, self.create, self.header = cache_id, create, header
        self.source, self.pending, self.open_chunks = source, pending, open_chunks
        self.on_chunk = on_chunk
        self.first_answer: "queue.Queue[Optional[pb.ImportSequencesResponse]]" = queue.Queue()
        self.source_error: Optional[AttnServeError] = None
        self.stop = threading.Event()

    def requests(self) -> Iterator[pb.ImportSequencesRequest]:
        first = pb.ImportSequencesRequest(cache_id=self.cache_id, header=self.header)
        if self.create is not None:
            first.create.CopyFrom(self.create)
        yield first
        answer = self.first_answer.get()
        if answer is None:  # the stream failed before answering
            return
        try:
            if self.source is None or not _resume_is_empty(answer.resume):
                # The receiver holds some of it (a resumed transfer): start there.
                _cancel(self.source)
                self.pending = []
                self.source = self.open_chunks(answer.resume, self.header.transfer_id)
            for chunk in self._chunks():
                if self.stop.is_set():
                    return
                chunk.ClearField("header")  # the opening message carried it
                self.on_chunk(chunk)
                yield pb.ImportSequencesRequest(chunk=chunk)
        except AttnServeError as e:
            # Half-closing makes the receiver answer where it stands (ABORTED); the
            # source's error decides whether to resume.
            self.source_error = e

    def _chunks(self) -> Iterator[pb.KvChunk]:
        yield from self.pending
        self.pending = []
        yield from self.source


def _cancel(source: Any) -> None:
    cancel = getattr(source, "cancel", None)
    if cancel is not None:
        cancel()


def push_chunks(client: Any, cache_id: str, open_chunks: OpenChunks, *,
                transfer_id: Optional[str] = None, capacity_tokens: Optional[int] = None,
                capacity_bytes: Optional[int] = None, device: Optional[int] = None,
                reserve: bool = False, max_resumes: int = DEFAULT_MAX_RESUMES,
                timeout: Optional[float] = None,
                progress: Optional[Progress] = None) -> TransferResult:
    """Sends the chunks `open_chunks` yields into `cache_id` on `client`'s server
    (ImportSequences), resuming after a broken stream up to `max_resumes` times:
    open_chunks(resume, transfer_id) is called again with the receiver's resume point.
    The capacity arguments make the receiver create the cache when it lacks it."""
    create = _create_request(capacity_tokens, capacity_bytes, device, reserve)
    transfer_id = transfer_id or f"py-{uuid.uuid4().hex}"
    stub = _stub(client)
    start = time.monotonic()
    header: Optional[pb.KvTransferHeader] = None
    sent = resent = 0
    keys = set()  # (sequence, layer, token_begin) of every chunk sent: a repeat is resent
    resumes = 0
    while True:
        source, pending = None, []
        if header is None:
            source = iter(open_chunks(None, transfer_id))
            first = next(source, None)
            if first is None:  # an export of no sequence sends no chunk, so no header
                raise AttnServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                     "chunks: the source sent none (a cache with no live "
                                     "sequences, or none of those asked, has nothing to move)")
            if not first.HasField("header"):
                _cancel(source)
                raise invalid_argument("chunks: expected a first chunk carrying the transfer's "
                                       "header, got one without")
            header = pb.KvTransferHeader()
            header.CopyFrom(first.header)
            transfer_id = header.transfer_id
            pending = [first]
        live = [0]

        def on_chunk(chunk: pb.KvChunk) -> None:
            nonlocal sent, resent
            key = (chunk.sequence_id, chunk.layer, chunk.token_begin)
            sent += payload_bytes(chunk)
            if key in keys:
                resent += payload_bytes(chunk)
            keys.add(key)
            if progress is not None:
                progress(sent, header.total_bytes, live[0])

        attempt = _Attempt(cache_id, create, header, source, pending, open_chunks, on_chunk)
        call = stub.ImportSequences(attempt.requests(), timeout=timeout,
                                    metadata=((CACHE_ID_HEADER, cache_id),))
        last: Optional[pb.ImportSequencesResponse] = None
        try:
            for resp in call:
                if last is None:
                    attempt.first_answer.put(resp)
                last = resp
                live[0] = len(resp.resume.committed_sequence_ids)
            error = None
        except grpc.RpcError as e:
            error = _error(e, "ImportSequences")
        finally:
            attempt.first_answer.put(None)  # unblocks a generator still waiting
            attempt.stop.set()
            _cancel(attempt.source)
        if error is None and last is not None and last.done:
            return TransferResult(
                transfer_id=transfer_id, bytes=sent, bytes_resent=resent,
                sequence_ids=list(last.resume.committed_sequence_ids), resumes=resumes,
                seconds=time.monotonic() - start, stats=last.stats)
        # The source's own error is the answer when it is not a break to resume.
        cause = attempt.source_error or error or AttnServeError(
            grpc.StatusCode.UNKNOWN, "ImportSequences: the stream ended without its last answer")
        if cause.code not in RESUMABLE or resumes >= max_resumes:
            raise cause
        resumes += 1


def import_sequences(client: Any, cache_id: str, chunks: Iterable[pb.KvChunk], *,
                     capacity_tokens: Optional[int] = None, capacity_bytes: Optional[int] = None,
                     device: Optional[int] = None, reserve: bool = False,
                     timeout: Optional[float] = None,
                     progress: Optional[Progress] = None) -> TransferResult:
    """Sends `chunks` (an export's, in order, the first with its header) into
    `cache_id` on `client`'s server as one stream. It cannot be re-read, so a broken
    stream raises (push_chunks, move_cache and import_file resume)."""
    opened = [False]

    def open_once(resume, transfer_id):
        if opened[0]:
            raise AttnServeError(grpc.StatusCode.ABORTED,
                                 "import_sequences: the stream broke and its chunks cannot be "
                                 "read again; resume with push_chunks or move_cache")
        opened[0] = True
        return chunks

    return push_chunks(client, cache_id, open_once, capacity_tokens=capacity_tokens,
                       capacity_bytes=capacity_bytes, device=device, reserve=reserve,
                       max_resumes=0, timeout=timeout, progress=progress)


def move_cache(src_client: Any, dst_client: Any, cache_id: str, *,
               dest_cache_id: Optional[str] = None, sequence_ids: Optional[Sequence[int]] = None,
               token_begin: int = 0, token_end: Optional[int] = None,
               capacity_tokens: Optional[int] = None, capacity_bytes: Optional[int] = None,
               device: Optional[int] = None, reserve: bool = False, max_chunk_bytes: int = 0,
               transfer_id: Optional[str] = None, max_resumes: int = DEFAULT_MAX_RESUMES,
               timeout: Optional[float] = None,
               progress: Optional[Progress] = None) -> TransferResult:
    """Copies `cache_id`'s sequences from src_client's server into dest_cache_id (None:
    the same id) on dst_client's, live with the same ids and lengths; the source keeps
    its copy. The export arguments are export_sequences'; the capacity ones make the
    receiver create the cache (geometry and page size from the source). A broken
    stream resumes where the receiver stands, up to max_resumes times; a transfer_id of
    a cut move continues it."""

    def open_export(resume, tid):
        return export_sequences(src_client, cache_id, sequence_ids=sequence_ids,
                                token_begin=token_begin, token_end=token_end,
                                max_chunk_bytes=max_chunk_bytes, transfer_id=tid, resume=resume,
                                timeout=timeout)

    return push_chunks(dst_client, dest_cache_id or cache_id, open_export,
                       transfer_id=transfer_id, capacity_tokens=capacity_tokens,
                       capacity_bytes=capacity_bytes, device=device, reserve=reserve,
                       max_resumes=max_resumes, timeout=timeout, progress=progress)


# -- chunk files ---------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def write_chunks(path: str, chunks: Iterable[pb.KvChunk]) -> int:
    """Writes chunks as a chunk file (each KvChunk preceded by its length as a varint)
    through "<path>.partial", renamed to path when all are written. Returns the count."""
    partial = f"{path}.partial"
    count = 0
    try:
        with open(partial, "wb") as f:
            for chunk in chunks:
                data = chunk.SerializeToString()
                f.write(_varint(len(data)))
                f.write(data)
                count += 1
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return count


def read_chunks(path: str) -> Iterator[pb.KvChunk]:
    """The chunks of a chunk file in order. INVALID_ARGUMENT naming the file, the chunk's
    index and byte offset for a cut length or message or bytes that are not a KvChunk."""
    with open(path, "rb") as f:
        index = offset = 0
        while True:
            start, length, shift = offset, 0, 0
            while True:
                b = f.read(1)
                if not b:
                    if shift == 0:
                        return
                    raise _file_error(path, index, start, "the file ends inside a length")
                offset += 1
                if shift > 56:
                    raise _file_error(path, index, start, "a length longer than 9 bytes")
                length |= (b[0] & 0x7F) << shift
                shift += 7
                if not b[0] & 0x80:
                    break
            if length > 1 << 31:
                raise _file_error(path, index, start, f"a length of {length} bytes")
            data = f.read(length)
            offset += len(data)
            if len(data) != length:
                raise _file_error(path, index, start, f"the file ends {length - len(data)} bytes "
                                                      f"inside a {length}-byte chunk")
            chunk = pb.KvChunk()
            try:
                chunk.ParseFromString(data)
            except Exception:  # google.protobuf.message.DecodeError
                raise _file_error(path, index, start,
                                  "the bytes do not parse as a KvChunk") from None
            index += 1
            yield chunk


def _file_error(path: str, index: int, offset: int, what: str) -> AttnServeError:
    return invalid_argument(f"{path}: not a K/V chunk file: chunk {index} at byte {offset}: "
                            f"{what}")


# Without google_crc32c the Python CRC runs at a few MB/s: larger files are checked
# for everything but their checksums (the server checks every chunk it receives).
_PURE_PYTHON_CRC_LIMIT = 64 << 20


def check_chunk_file(path: str, *, verify_crc: Optional[bool] = None) -> pb.KvTransferHeader:
    """Reads a whole chunk file and checks it: one header first, each chunk's CRC-32C,
    every sequence of the header ended and every payload byte present. Returns the
    header; INVALID_ARGUMENT naming the chunk otherwise. verify_crc None: checksums
    are checked when google_crc32c is installed or the file is at most 64 MiB."""
    if verify_crc is None:
        verify_crc = _crc_fast or os.path.getsize(path) <= _PURE_PYTHON_CRC_LIMIT
    header, ended, total = None, 0, 0
    for i, chunk in enumerate(read_chunks(path)):
        where = (f"{path}: chunk {i} (sequence {chunk.sequence_id}, layer {chunk.layer}, "
                 f"tokens {chunk.token_begin}..{chunk.token_begin + chunk.num_tokens})")
        if i == 0:
            if not chunk.HasField("header"):
                raise invalid_argument(f"{where}: the first chunk has no header")
            header = chunk.header
        elif chunk.HasField("header"):
            raise invalid_argument(f"{where}: a header after the first chunk")
        crc = chunk_crc32c(chunk) if verify_crc else chunk.crc32c
        if crc != chunk.crc32c:
            raise invalid_argument(f"{where}: crc32c mismatch: the chunk says {chunk.crc32c}, "
                                   f"its bytes give {crc} (the file is damaged)")
        ended += chunk.sequence_end
        total += payload_bytes(chunk)
    if header is None:
        raise invalid_argument(f"{path}: empty (no chunk, no header)")
    if ended != len(header.sequences) or total != header.total_bytes:
        raise invalid_argument(f"{path}: incomplete: {ended} of {len(header.sequences)} "
                               f"sequences end in it, {total} of {header.total_bytes} payload "
                               "bytes")
    return header


def skip_received(chunks: Iterable[pb.KvChunk], resume: Optional[pb.ImportResumePoint],
                  transfer_id: str) -> Iterator[pb.KvChunk]:
    """An export's chunks from a receiver's resume point on: committed sequences
    skipped, the current one's rows it holds cut off (a chunk holding some of them is
    cut to the rest, its CRC-32C computed again); the header, with transfer_id, on the
    first chunk yielded."""
    committed = set(resume.committed_sequence_ids) if resume is not None else set()
    current = resume.sequence_id if resume is not None and resume.HasField("sequence_id") else None
    header = None
    for chunk in chunks:
        if chunk.HasField("header"):
            header = pb.KvTransferHeader()
            header.CopyFrom(chunk.header)
            header.transfer_id = transfer_id
            chunk.ClearField("header")
        if chunk.sequence_id in committed:
            continue
        if current is not None and chunk.sequence_id == current:
            if chunk.layer < resume.layer:
                continue
            if chunk.layer == resume.layer:
                end = chunk.token_begin + chunk.num_tokens
                if chunk.num_tokens and end <= resume.token:
                    continue
                skip = resume.token - chunk.token_begin
                if skip > 0:
                    for name in ("k", "v", "k_scale", "v_scale"):
                        part = getattr(chunk, name)
                        setattr(chunk, name, part[len(part) // chunk.num_tokens * skip:])
                    chunk.token_begin, chunk.num_tokens = resume.token, end - resume.token
                    chunk.crc32c = chunk_crc32c(chunk)
        if header is not None:
            chunk.header.CopyFrom(header)
            header = None
        yield chunk


def import_file(client: Any, path: str, cache_id: str, *, transfer_id: Optional[str] = None,
                capacity_tokens: Optional[int] = None, capacity_bytes: Optional[int] = None,
                device: Optional[int] = None, reserve: bool = False,
                max_resumes: int = DEFAULT_MAX_RESUMES, timeout: Optional[float] = None,
                progress: Optional[Progress] = None) -> TransferResult:
    """Sends a chunk file (check_chunk_file first: a damaged file changes nothing) into
    `cache_id`, resuming a cut stream by skipping what the receiver holds."""
    check_chunk_file(path)
    return push_chunks(client, cache_id,
                       lambda resume, tid: skip_received(read_chunks(path), resume, tid),
                       transfer_id=transfer_id, capacity_tokens=capacity_tokens,
                       capacity_bytes=capacity_bytes, device=device, reserve=reserve,
                       max_resumes=max_resumes, timeout=timeout, progress=progress)


def export_file(client: Any, cache_id: str, path: str, *,
                sequence_ids: Optional[Sequence[int]] = None, token_begin: int = 0,
                token_end: Optional[int] = None, max_chunk_bytes: int = 0,
                max_resumes: int = DEFAULT_MAX_RESUMES, timeout: Optional[float] = None) -> int:
    """Writes an export of `cache_id` to a chunk file, resuming a cut stream after the
    last chunk written. Returns the number of chunks."""
    written: List[pb.KvChunk] = []
    header: Optional[pb.KvTransferHeader] = None
    ended: List[int] = []

    def chunks() -> Iterator[pb.KvChunk]:
        nonlocal header
        resumes = 0
        while True:
            resume = None if header is None else _resume_after(header, ended, written[-1:])
            stream = export_sequences(client, cache_id, sequence_ids=sequence_ids,
                                      token_begin=token_begin, token_end=token_end,
                                      max_chunk_bytes=max_chunk_bytes,
                                      transfer_id=None if header is None else header.transfer_id,
                                      resume=resume, timeout=timeout)
            try:
                for chunk in stream:
                    if chunk.HasField("header"):
                        if header is None:
                            header = chunk.header
                        else:
                            chunk.ClearField("header")  # a resumed stream sends it again
                    if chunk.sequence_end:
                        ended.append(chunk.sequence_id)
                    written[:] = [chunk]
                    yield chunk
                return
            except AttnServeError as e:
                if e.code not in RESUMABLE or resumes >= max_resumes:
                    raise
                resumes += 1

    return write_chunks(path, chunks())


def _resume_after(header: pb.KvTransferHeader, ended: List[int],
                  last: List[pb.KvChunk]) -> pb.ImportResumePoint:
    """Where a receiver of the chunks so far would stand."""
    point = pb.ImportResumePoint(committed_sequence_ids=ended)
    if not last or last[0].sequence_end:
        return point
    chunk = last[0]
    layer, token = chunk.layer, chunk.token_begin + chunk.num_tokens
    for s in header.sequences:
        # A layer written to its end: the next row is the next layer's first.
        if s.sequence_id == chunk.sequence_id and token >= s.lengths[layer] \
                and layer + 1 < len(s.lengths):
            layer, token = layer + 1, header.token_begin
    point.sequence_id, point.layer, point.token = chunk.sequence_id, layer, token
    return point
