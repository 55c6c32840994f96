"""forward()'s score modifiers and masks (alibi_slopes, sinks, bias, mask, block_mask) into
a request's AttentionOptions, checked against the call's shapes first; and the K/V API's
(append_attend's alibi_slopes, sinks, bias, mask and per-sequence attend_pages).

The checks are the ones the server makes on sizes and structure, so a mistake is reported
here with the argument's name before anything is sent; the values of a bias (NaN, +inf)
are left to the server, which names the field, as reading them costs a pass over the
tensor. The bias and mask travel as tensors of attnserve._wire (no copy of their data);
the rest go through the generated class.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from attnserve import _tensors, _wire
from attnserve.errors import invalid_argument
from attnserve.masks import BlockMask
from attnserve.v1 import attention_pb2 as pb


class CallShape:
    """What the checks need of a call: B, Hq and each sequence's (sq, sk)."""

    def __init__(self, q_shape: Sequence[int], k_shape: Sequence[int],
                 cu_q: Optional[Sequence[int]], cu_k: Optional[Sequence[int]]):
        self.varlen = cu_q is not None
        if self.varlen:
            if cu_k is None or len(cu_q) != len(cu_k) or len(q_shape) != 3:
                raise invalid_argument("score modifiers and masks need a well-formed call: "
                                       "cu_seqlens_q and cu_seqlens_k of B+1 entries with "
                                       f"q [Tq, Hq, D], got q shape {tuple(q_shape)}")
            self.batch = len(cu_q) - 1
            self.lens = [(cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]) for b in range(self.batch)]
            self.heads = int(q_shape[1])
        else:
            if len(q_shape) != 4 or len(k_shape) != 4:
                raise invalid_argument("score modifiers and masks need a well-formed call: "
                                       f"q [B, Sq, Hq, D] and k [B, Sk, Hkv, D], got "
                                       f"{tuple(q_shape)} and {tuple(k_shape)}")
            self.batch = int(q_shape[0])
            self.seqlen_q, self.seqlen_k = int(q_shape[1]), int(k_shape[1])
            self.lens = [(self.seqlen_q, self.seqlen_k)] * self.batch
            self.heads = int(q_shape[2])
        self.total_pairs = sum(sq * sk for sq, sk in self.lens)

    def check_pair_shape(self, name: str, shape: Tuple[int, ...]) -> None:
        """bias/mask: dense [B or 1, Hq or 1, Sq, Sk], varlen [Hq or 1, P]."""
        if self.varlen:
            if len(shape) != 2 or shape[0] not in (1, self.heads) or shape[1] != self.total_pairs:
                raise invalid_argument(f"{name}: varlen calls take [Hq or 1, P] = [{self.heads} "
                                       f"or 1, {self.total_pairs}] (P = sum of sq_b * sk_b), got "
                                       f"{list(shape)}")
            return
        if (len(shape) != 4 or shape[0] not in (1, self.batch) or shape[1] not in (1, self.heads)
                or shape[2] != self.seqlen_q or shape[3] != self.seqlen_k):
            raise invalid_argument(f"{name}: dense calls take [B or 1, Hq or 1, Sq, Sk] = "
                                   f"[{self.batch} or 1, {self.heads} or 1, {self.seqlen_q}, "
                                   f"{self.seqlen_k}], got {list(shape)}")


def _per_head(name: str, values: Any, heads: Optional[int], heads_kv: int = 0) -> List[float]:
    """[Hq] finite values; heads None (a K/V call without q): Hq unknown, any positive
    multiple of heads_kv, as the server takes them."""
    if _tensors.is_torch(values):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values, dtype=np.float64)
    if heads is None:
        if arr.ndim != 1 or arr.size == 0 or arr.size % heads_kv:
            raise invalid_argument(f"{name}: expected one value per query head (without q, a "
                                   f"positive multiple of Hkv = {heads_kv}), got shape "
                                   f"{arr.shape}")
    elif arr.shape != (heads,):
        raise invalid_argument(f"{name}: expected one value per query head, shape ({heads},), "
                               f"got {arr.shape}")
    if not np.isfinite(arr).all():
        raise invalid_argument(f"{name}[{int(np.argmin(np.isfinite(arr)))}] must be finite")
    return arr.astype(np.float32).tolist()


def _bias_tensor(bias: Any) -> _wire.OutTensor:
    t = _tensors.to_out("bias", bias)
    if t.dtype == pb.FP8_E4M3:
        raise invalid_argument("bias.dtype: expected float32, float16 or bfloat16, got "
                               "float8_e4m3fn")
    return t


def _mask_tensor(mask: Any) -> _wire.OutTensor:
    if _tensors.is_torch(mask):
        mask = mask.detach().cpu().numpy()
    arr = np.asarray(mask)
    if arr.dtype != np.bool_ and arr.dtype != np.uint8:
        raise invalid_argument(f"mask.dtype: expected bool (True = attend) or uint8, got "
                               f"{arr.dtype}")
    data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return _wire.OutTensor(0, tuple(arr.shape), data)


def _check_block_mask(m: Any, call: CallShape) -> None:
    if not isinstance(m, BlockMask):
        raise invalid_argument(f"block_mask: expected an attnserve.masks.BlockMask, got "
                               f"{type(m).__name__}")
    if m.num_heads not in (1, call.heads):
        raise invalid_argument(f"block_mask.num_heads: expected {call.heads} or 1, got "
                               f"{m.num_heads}")
    if call.varlen and m.num_batch != call.batch:
        raise invalid_argument(f"block_mask.num_batch: expected {call.batch} (varlen: one per "
                               f"sequence), got {m.num_batch}")
    if not call.varlen and m.num_batch not in (1, call.batch):
        raise invalid_argument(f"block_mask.num_batch: expected {call.batch} or 1, got "
                               f"{m.num_batch}")
    # Key blocks of each CSR row, in row order.
    def seq_rows(sq: int, sk: int) -> List[int]:
        return [-(-sk // m.block_k)] * (-(-sq // m.block_q))

    if call.varlen:
        per_head = [n for sq, sk in call.lens for n in seq_rows(sq, sk)]
        kblocks = per_head * m.num_heads
    else:
        seqs = call.lens[:m.num_batch]
        kblocks = [n for sq, sk in seqs for _ in range(m.num_heads) for n in seq_rows(sq, sk)]
    if m.num_rows != len(kblocks):
        raise invalid_argument(f"block_mask: {m.num_rows} rows (row_ptr has {m.row_ptr.size} "
                               f"entries), the call needs {len(kblocks)} (one per sequence, "
                               f"head and query block of {m.block_q})")
    if m.kept:
        limit = np.repeat(np.asarray(kblocks, dtype=np.int64), np.diff(m.row_ptr))
        bad = m.col_idx >= limit
        if bad.any():
            i = int(np.argmax(bad))
            row = int(np.searchsorted(m.row_ptr, i, side="right")) - 1
            raise invalid_argument(f"block_mask.col_idx[{i}] = {m.col_idx[i]} (row {row}) must "
                                   f"be < {limit[i]}, the key blocks of {m.block_k} there")


def apply(opts: pb.AttentionOptions, call: CallShape, *, alibi_slopes: Any = None,
          sinks: Any = None, bias: Any = None, mask: Any = None,
          block_mask: Optional[BlockMask] = None) -> List[Tuple[str, Any]]:
    """Sets alibi_slopes, sinks and block_mask on `opts`; returns the ("options.bias",
    tensor) and ("options.mask", tensor) pieces for attnserve._wire.encode."""
    tensors: List[Tuple[str, Any]] = []
    if alibi_slopes is not None:
        opts.alibi_slopes.extend(_per_head("alibi_slopes", alibi_slopes, call.heads))
    if sinks is not None:
        opts.sinks.extend(_per_head("sinks", sinks, call.heads))
    if bias is not None:
        t = _bias_tensor(bias)
        call.check_pair_shape("bias", t.shape)
        tensors.append(("options.bias", t))
    if mask is not None:
        t = _mask_tensor(mask)
        call.check_pair_shape("mask", t.shape)
        tensors.append(("options.mask", t))
    if block_mask is not None:
        _check_block_mask(block_mask, call)
        m = opts.block_mask
        m.block_q, m.block_k = block_mask.block_q, block_mask.block_k
        m.num_batch, m.num_heads = block_mask.num_batch, block_mask.num_heads
        m.row_ptr.extend(block_mask.row_ptr.tolist())
        m.col_idx.extend(block_mask.col_idx.tolist())
    return tensors


# -- the K/V API (attnserve.kv) ---------------------------------------------------
def apply_kv(opts: pb.AttentionOptions, heads: Optional[int], heads_kv: int, *,
             alibi_slopes: Any = None, sinks: Any = None) -> None:
    """append_attend's alibi_slopes and sinks onto `opts` ([Hq] each; heads None: no q)."""
    if alibi_slopes is not None:
        opts.alibi_slopes.extend(_per_head("alibi_slopes", alibi_slopes, heads, heads_kv))
    if sinks is not None:
        opts.sinks.extend(_per_head("sinks", sinks, heads, heads_kv))


def _packed_pairs(name: str, x: Any, nq: List[int], after: List[int]) -> Any:
    """A K/V step's bias or mask as the wire's [Hq or 1, P]: 2-D as given; 4-D
    [B or 1, Hq or 1, Sq, L] when every sequence has Sq queries and L tokens after the
    append, each sequence's [Sq, L] block laid out one after another per head."""
    if _tensors.is_torch(x):
        ndim, shape = x.dim(), tuple(x.shape)
    else:
        x = np.asarray(x)
        ndim, shape = x.ndim, x.shape
    if ndim == 2:
        return x
    batch = len(nq)
    if ndim != 4 or shape[0] not in (1, batch):
        raise invalid_argument(f"{name}: expected [Hq or 1, P] (packed: each sequence's "
                               f"[num_queries, length after the append] one after another) or "
                               f"[B or 1, Hq or 1, Sq, L] with B = {batch}, got {list(shape)}")
    if set(nq) != {shape[2]} or set(after) != {shape[3]}:
        raise invalid_argument(f"{name}: a 4-D {list(shape)} needs every sequence to have Sq = "
                               f"{shape[2]} queries and L = {shape[3]} tokens after the append, "
                               f"got queries {nq} and lengths {after}; send the packed "
                               f"[Hq or 1, P] layout instead")
    full = (batch, shape[1], shape[2], shape[3])
    if _tensors.is_torch(x):
        return x.expand(full).permute(1, 0, 2, 3).reshape(shape[1], -1)
    return np.ascontiguousarray(np.broadcast_to(x, full).transpose(1, 0, 2, 3)).reshape(
        shape[1], -1)


def kv_pair_tensors(heads: Optional[int], nq: List[int], after: List[int], *, bias: Any = None,
                    mask: Any = None) -> List[Tuple[str, Any]]:
    """append_attend's bias and mask: each sequence's queries (nq) over its whole history
    after the append (after), [Hq or 1, P] with P = sum of nq_b * after_b (kv.proto), as
    ("options.bias" / "options.mask", tensor) pieces for attnserve._wire.encode."""
    pairs = sum(a * b for a, b in zip(nq, after))
    out: List[Tuple[str, Any]] = []
    for name, x, to_tensor in (("bias", bias, _bias_tensor), ("mask", mask, _mask_tensor)):
        if x is None:
            continue
        t = to_tensor(_packed_pairs(name, x, nq, after))
        if (len(t.shape) != 2 or t.shape[1] != pairs
                or (heads is not None and t.shape[0] not in (1, heads))):
            raise invalid_argument(f"{name}: expected [Hq or 1, P] = [{heads or 'Hq'} or 1, "
                                   f"{pairs}] (P = sum over the sequences of num_queries * "
                                   f"their length after the append), got {list(t.shape)}")
        out.append((f"options.{name}", t))
    return out


def attend_pages_of(attend_pages: Any, batch: int) -> List[Optional[List[int]]]:
    """append_attend's attend_pages: one entry per sequence, None (or empty) = all pages,
    else the page indices as ints; checked for structure (the values: check_pages)."""
    if attend_pages is None:
        return [None] * batch
    if isinstance(attend_pages, (str, bytes)) or not hasattr(attend_pages, "__len__"):
        raise invalid_argument(f"attend_pages: expected a list of {batch} entries (one per "
                               f"sequence: page indices or None), got "
                               f"{type(attend_pages).__name__}")
    if len(attend_pages) != batch:
        raise invalid_argument(f"attend_pages: expected {batch} entries (one per sequence), "
                               f"got {len(attend_pages)}")
    out: List[Optional[List[int]]] = []
    for i, pages in enumerate(attend_pages):
        if pages is None:
            out.append(None)
            continue
        if _tensors.is_torch(pages):
            pages = pages.detach().cpu().numpy()
        arr = np.asarray(pages)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise invalid_argument(f"attend_pages[{i}]: expected a list of integer page indices "
                                   f"or None, got {arr.dtype} of shape {arr.shape}")
        out.append([int(p) for p in arr] or None)
    return out


def check_pages(i: int, pages: List[int], sequence_id: int, length: int,
                page_size: int) -> None:
    """Sequence i's attend_pages against its history of `length` tokens (as tracked here):
    strictly increasing indices of pages that history fills."""
    history = -(-length // page_size)
    for j, p in enumerate(pages):
        if p < 0 or p >= history or (j > 0 and p <= pages[j - 1]):
            after = f" after {pages[j - 1]}" if j > 0 else ""
            raise invalid_argument(
                f"attend_pages[{i}]: expected strictly increasing page indices in [0, "
                f"{history}) (sequence {sequence_id} holds {length} tokens in pages of "
                f"{page_size}), got attend_pages[{i}][{j}] = {p}{after}")
