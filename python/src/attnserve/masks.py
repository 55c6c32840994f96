"""Score modifiers and masks for forward(): block-sparse masks, ALiBi slopes, test patterns.

    from attnserve.masks import BlockMask, alibi_slopes
    bm = BlockMask.from_dense(blocks)                  # bool [B or 1, H or 1, Qblocks, Kblocks]
    o = client.forward(q, k, v, block_mask=bm, alibi_slopes=alibi_slopes(q.shape[2]))

What each kind means, the order they apply in and the layouts: docs/masks.md (and the
AttentionOptions comments of proto/attnserve/v1/attention.proto).

A BlockMask says which (query block, key block) pairs are attended, in compressed
sparse rows: row r keeps the key blocks col_idx[row_ptr[r]:row_ptr[r + 1]] (strictly
increasing). Rows are one per (sequence, head, query block):
  dense   [num_batch (B or 1), num_heads (Hq or 1), ceil(Sq / block_q)], row-major
  varlen  [num_heads (Hq or 1), sum over sequences of ceil(sq_b / block_q)], num_batch = B
block_q and block_k are multiples of 128: the Hopper kernel's query tile is 128 rows
and every kernel's key tile (64 or 128 keys) then lies inside one key block.

torch is imported only by from_flex() and element_mask_from_flex().
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Sequence

import numpy as np

from attnserve.errors import invalid_argument

# Block sizes are multiples of this (backend/params.h kBlockMaskGrain).
BLOCK_GRAIN = 128


def _check_block_size(name: str, size: Any) -> int:
    if not isinstance(size, (int, np.integer)) or size <= 0 or size % BLOCK_GRAIN:
        raise invalid_argument(f"{name}: expected a positive multiple of {BLOCK_GRAIN}, "
                               f"got {size!r}")
    return int(size)


def _int32_vector(name: str, values: Any) -> np.ndarray:
    if _is_torch(values):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise invalid_argument(f"{name}: expected a 1-D array of integers, got shape "
                               f"{arr.shape} of {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise invalid_argument(f"{name}: values must fit in int32")
    return arr.astype(np.int32)


def _is_torch(x: Any) -> bool:
    import sys
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class BlockMask:
    """A block-sparse mask (attnserve.v1.BlockMask); see the module docstring.

    Construction checks the CSR structure (row_ptr from 0, non-decreasing, ending at
    len(col_idx); columns strictly increasing within a row and >= 0) and the block
    sizes. Whether the rows and column ranges fit a call's lengths is checked by
    forward() (client side, naming the field) and by the server.
    """
    block_q: int
    block_k: int
    num_batch: int
    num_heads: int
    row_ptr: np.ndarray
    col_idx: np.ndarray

    def __post_init__(self) -> None:
        self.block_q = _check_block_size("block_mask.block_q", self.block_q)
        self.block_k = _check_block_size("block_mask.block_k", self.block_k)
        for name in ("num_batch", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise invalid_argument(f"block_mask.{name}: expected an integer >= 1, "
                                       f"got {value!r}")
            setattr(self, name, int(value))
        self.row_ptr = _int32_vector("block_mask.row_ptr", self.row_ptr)
        self.col_idx = _int32_vector("block_mask.col_idx", self.col_idx)
        rp, ci = self.row_ptr, self.col_idx
        if rp.size == 0 or rp[0] != 0:
            raise invalid_argument("block_mask.row_ptr: expected rows + 1 entries starting at 0, "
                                   f"got {rp[:4].tolist()}...")
        steps = np.diff(rp)
        if steps.size and steps.min() < 0:
            r = int(np.argmax(steps < 0))
            raise invalid_argument(f"block_mask.row_ptr must be non-decreasing, but "
                                   f"row_ptr[{r + 1}] = {rp[r + 1]} < row_ptr[{r}] = {rp[r]}")
        if rp[-1] != ci.size:
            raise invalid_argument(f"block_mask.row_ptr[-1] = {rp[-1]} must equal "
                                   f"len(col_idx) = {ci.size}")
        if ci.size and ci.min() < 0:
            raise invalid_argument(f"block_mask.col_idx: negative entry {int(ci.min())}")
        # Strictly increasing within each row: a step <= 0 that is not at a row start.
        if ci.size > 1:
            bad = np.diff(ci) <= 0
            bad[rp[1:-1][(rp[1:-1] > 0) & (rp[1:-1] < ci.size)] - 1] = False
            if bad.any():
                i = int(np.argmax(bad)) + 1
                raise invalid_argument(f"block_mask.col_idx must increase strictly within a "
                                       f"row, but col_idx[{i}] = {ci[i]} <= col_idx[{i - 1}] "
                                       f"= {ci[i - 1]}")

    @property
    def num_rows(self) -> int:
        return self.row_ptr.size - 1

    @property
    def kept(self) -> int:
        """Kept (query block, key block) pairs over all rows."""
        return int(self.col_idx.size)

    # -- builders ------------------------------------------------------------
    @classmethod
    def from_dense(cls, blocks: Any, block_q: int = BLOCK_GRAIN,
                   block_k: int = BLOCK_GRAIN) -> "BlockMask":
        """A dense call's mask from bool blocks [B or 1, H or 1, Qblocks, Kblocks] (numpy or
        torch; True = attend). Qblocks = ceil(Sq / block_q), Kblocks = ceil(Sk / block_k)."""
        arr = _bool_array("blocks", blocks)
        if arr.ndim != 4:
            raise invalid_argument(f"blocks: expected bool [B or 1, H or 1, Qblocks, Kblocks], "
                                   f"got shape {arr.shape}")
        nb, nh, qb, kb = arr.shape
        flat = arr.reshape(nb * nh * qb, kb)
        counts = flat.sum(axis=1)
        row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        col_idx = np.nonzero(flat)[1].astype(np.int32)  # row-major: ascending within a row
        return cls(block_q, block_k, max(nb, 1), max(nh, 1), row_ptr, col_idx)

    @classmethod
    def from_sequences(cls, blocks: Sequence[Any], block_q: int = BLOCK_GRAIN,
                       block_k: int = BLOCK_GRAIN) -> "BlockMask":
        """A varlen call's mask from one bool array per sequence, [H or 1, Qblocks_b,
        Kblocks_b] (Qblocks_b = ceil(sq_b / block_q), Kblocks_b = ceil(sk_b / block_k));
        every sequence has the same H (1: shared by all heads)."""
        arrays = [_bool_array(f"blocks[{b}]", x) for b, x in enumerate(blocks)]
        heads = {a.shape[0] for a in arrays if a.ndim == 3}
        if any(a.ndim != 3 for a in arrays) or len(heads) > 1:
            raise invalid_argument("blocks: expected one bool [H or 1, Qblocks_b, Kblocks_b] per "
                                   f"sequence with one H, got shapes {[a.shape for a in arrays]}")
        nh = heads.pop() if heads else 1
        counts: List[int] = []
        cols: List[np.ndarray] = []
        for h in range(nh):
            for a in arrays:
                for row in a[h]:
                    idx = np.nonzero(row)[0]
                    counts.append(idx.size)
                    cols.append(idx)
        row_ptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32)
        col_idx = np.concatenate(cols).astype(np.int32) if cols else np.zeros(0, np.int32)
        return cls(block_q, block_k, max(len(arrays), 1), max(nh, 1), row_ptr, col_idx)

    def to_dense(self, num_k_blocks: int) -> np.ndarray:
        """This (dense-call) mask as bool [num_batch, num_heads, Qblocks, num_k_blocks]."""
        per = self.num_batch * self.num_heads
        if self.num_rows % per:
            raise invalid_argument(f"block_mask: {self.num_rows} rows are not num_batch * "
                                   f"num_heads = {per} times the query blocks")
        if self.kept and int(self.col_idx.max()) >= num_k_blocks:
            raise invalid_argument(f"num_k_blocks = {num_k_blocks} is not more than the largest "
                                   f"column {int(self.col_idx.max())}")
        out = np.zeros((self.num_rows, num_k_blocks), dtype=bool)
        rows = np.repeat(np.arange(self.num_rows), np.diff(self.row_ptr))
        out[rows, self.col_idx] = True
        return out.reshape(self.num_batch, self.num_heads, self.num_rows // per, num_k_blocks)

    @classmethod
    def from_flex(cls, flex_block_mask: Any, *, require_exact: bool = False) -> "BlockMask":
        """A PyTorch FlexAttention BlockMask (torch.nn.attention.flex_attention) as a BlockMask.

        Both of FlexAttention's block lists are kept blocks: the partial ones
        (kv_num_blocks/kv_indices) and the full ones (full_kv_num_blocks/full_kv_indices).
        Its BLOCK_SIZE must be multiples of 128 (FlexAttention's default is 128).

        Exactness: FlexAttention applies its mask_mod element by element inside partial
        blocks; a BlockMask has no elements, so the conversion is exact only when there are
        no partial blocks, i.e. the mask_mod is block-aligned (every block all-true or
        all-false). Otherwise also pass mask=element_mask_from_flex(...) to forward(), or
        use require_exact=True to get an error instead.
        """
        bm = flex_block_mask
        for attr in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE"):
            if not hasattr(bm, attr):
                raise invalid_argument(f"from_flex: expected a torch.nn.attention.flex_attention."
                                       f"BlockMask, got {type(bm).__name__} without {attr}")
        size = bm.BLOCK_SIZE
        block_q, block_k = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        for name, s in (("BLOCK_SIZE[0]", block_q), ("BLOCK_SIZE[1]", block_k)):
            if s % BLOCK_GRAIN:
                raise invalid_argument(f"from_flex: {name} = {s} is not a multiple of "
                                       f"{BLOCK_GRAIN}; build it with BLOCK_SIZE=128 (or a "
                                       "multiple)")
        num = bm.kv_num_blocks.detach().cpu().numpy().astype(np.int64)
        idx = bm.kv_indices.detach().cpu().numpy().astype(np.int64)
        full_num = getattr(bm, "full_kv_num_blocks", None)
        full_idx = getattr(bm, "full_kv_indices", None)
        if require_exact and num.sum() > 0:
            raise invalid_argument(f"from_flex: {int(num.sum())} partial blocks (mask_mod is not "
                                   "block-aligned); a block mask alone would attend all of them")
        if full_num is not None:
            full_num = full_num.detach().cpu().numpy().astype(np.int64)
            full_idx = full_idx.detach().cpu().numpy().astype(np.int64)
        nb, nh, qb = num.shape
        num_k_blocks = idx.shape[-1]
        if full_idx is not None:
            num_k_blocks = max(num_k_blocks, full_idx.shape[-1])
        dense = np.zeros((nb, nh, qb, num_k_blocks), dtype=bool)
        for n, ix in ((num, idx), (full_num, full_idx)):
            if n is None:
                continue
            take = np.arange(ix.shape[-1])[None, None, None, :] < n[..., None]
            b, h, r, j = np.nonzero(take)
            dense[b, h, r, ix[b, h, r, j]] = True
        # FlexAttention's kv_indices may be padded past the real key blocks (it rounds to
        # its own sizes); the length of the key sequence trims them.
        seq_lengths = getattr(bm, "seq_lengths", None)
        if seq_lengths is not None:
            dense = dense[..., :_ceil_div(int(seq_lengths[1]), block_k)]
            dense = dense[:, :, :_ceil_div(int(seq_lengths[0]), block_q)]
        return cls.from_dense(dense, block_q, block_k)


def _bool_array(name: str, x: Any) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype != np.bool_ and arr.dtype != np.uint8:
        raise invalid_argument(f"{name}: expected a bool array, got {arr.dtype}")
    return arr.astype(bool)


def element_mask_from_flex(flex_block_mask: Any, seqlen_q: Optional[int] = None,
                           seqlen_k: Optional[int] = None, *, batch: Optional[int] = None,
                           heads: Optional[int] = None) -> np.ndarray:
    """The element mask of a FlexAttention BlockMask's mask_mod, evaluated densely
    (torch.nn.attention.flex_attention.create_mask) as bool [B or 1, H or 1, Sq, Sk] for
    forward(mask=...): exact where from_flex() alone is not. Costs Sq * Sk bytes per
    (batch, head) that the mask_mod depends on: batch/heads None = 1 (the mask_mod must
    then not read b/h), else the call's B/Hq. seqlen_q/k default to the BlockMask's."""
    from torch.nn.attention.flex_attention import create_mask
    mask_mod = getattr(flex_block_mask, "mask_mod", None)
    if mask_mod is None:
        raise invalid_argument("element_mask_from_flex: the BlockMask has no mask_mod")
    lengths = getattr(flex_block_mask, "seq_lengths", None)
    if seqlen_q is None or seqlen_k is None:
        if lengths is None:
            raise invalid_argument("element_mask_from_flex: pass seqlen_q and seqlen_k (this "
                                   "BlockMask does not record them)")
        seqlen_q = int(lengths[0]) if seqlen_q is None else seqlen_q
        seqlen_k = int(lengths[1]) if seqlen_k is None else seqlen_k
    mask = create_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, device="cpu")
    return mask.numpy().astype(bool)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes (float32 [num_heads]): 2^(-8/n), 2^(-16/n), ... for n a
    power of two; otherwise those of the largest power of two below n followed by every
    other slope of twice that (the paper's code, and BLOOM's)."""
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise invalid_argument(f"num_heads: expected an integer >= 1, got {num_heads!r}")

    def power_of_two(n: int) -> List[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][:num_heads - closest]
    return np.asarray(slopes, dtype=np.float32)


# -- test and benchmark patterns ---------------------------------------------------------
def _lengths(seqlen_q: Any, seqlen_k: Any, batch: int, cu_seqlens_q: Any, cu_seqlens_k: Any):
    if cu_seqlens_q is None:
        return [(int(seqlen_q), int(seqlen_k))] * batch, False
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    return [(int(cq[b + 1] - cq[b]), int(ck[b + 1] - ck[b])) for b in range(cq.size - 1)], True


def _kept(density: float, n: int) -> int:
    """round(density * n), halves away from zero (as attnctl rounds)."""
    return int(math.floor(density * n + 0.5))


def _pattern_mask(row_blocks, seqlen_q, seqlen_k, batch, heads, block_q, block_k,
                  cu_seqlens_q, cu_seqlens_k) -> BlockMask:
    _check_block_size("block_q", block_q)
    _check_block_size("block_k", block_k)
    lens, varlen = _lengths(seqlen_q, seqlen_k, batch, cu_seqlens_q, cu_seqlens_k)
    per_seq = []
    for sq, sk in lens:
        qb, kb = _ceil_div(sq, block_q), _ceil_div(sk, block_k)
        blocks = np.zeros((heads, qb, kb), dtype=bool)
        for h in range(heads):
            for r in range(qb):
                last = min((r + 1) * block_q, sq) - 1
                diag = max(last + sk - sq, 0) // block_k
                blocks[h, r, row_blocks(kb, min(diag, max(kb - 1, 0)))] = True
        per_seq.append(blocks)
    if varlen:
        return BlockMask.from_sequences(per_seq, block_q, block_k)
    return BlockMask.from_dense(np.stack(per_seq), block_q, block_k)


def random_block_mask(seqlen_q: int, seqlen_k: int, density: float, *, batch: int = 1,
                      heads: int = 1, block_q: int = BLOCK_GRAIN, block_k: int = BLOCK_GRAIN,
                      cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                      seed: Optional[int] = None) -> BlockMask:
    """round(density * n) of each row's n key blocks, uniformly at random (attnctl
    --block_pattern=random). Dense [batch, heads, ..] rows, or varlen rows when
    cu_seqlens_q/k are given (seqlen_q/k and batch are then ignored)."""
    if not 0.0 <= density <= 1.0:
        raise invalid_argument(f"density: expected a fraction in [0, 1], got {density!r}")
    rng = np.random.default_rng(seed)

    def row(n: int, diag: int) -> np.ndarray:
        return rng.choice(n, size=_kept(density, n), replace=False)

    return _pattern_mask(row, seqlen_q, seqlen_k, batch, heads, block_q, block_k, cu_seqlens_q,
                         cu_seqlens_k)


def stripes_block_mask(seqlen_q: int, seqlen_k: int, density: float, *, batch: int = 1,
                       heads: int = 1, block_q: int = BLOCK_GRAIN, block_k: int = BLOCK_GRAIN,
                       cu_seqlens_q: Any = None, cu_seqlens_k: Any = None) -> BlockMask:
    """Local + global stripes (attnctl --block_pattern=stripes): of the round(density * n)
    key blocks a row keeps, the first quarter are global columns 0, 1, ... and the rest a
    band ending at the row's diagonal block (bottom-right aligned), extended to the right
    where the band runs out of blocks on the left."""
    if not 0.0 <= density <= 1.0:
        raise invalid_argument(f"density: expected a fraction in [0, 1], got {density!r}")

    def row(n: int, diag: int) -> List[int]:
        keep = _kept(density, n)
        kept = set(range(keep // 4))
        for c in list(range(diag, -1, -1)) + list(range(diag + 1, n)):
            if len(kept) >= keep:
                break
            kept.add(c)
        return sorted(kept)

    return _pattern_mask(row, seqlen_q, seqlen_k, batch, heads, block_q, block_k, cu_seqlens_q,
                         cu_seqlens_k)
