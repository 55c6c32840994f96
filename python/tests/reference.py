"""A float64 NumPy reference of attention with the contract's masking rules (docs/design.md §2)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np


def attention_one(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool,
                  window: Optional[Tuple[Optional[int], Optional[int]]], softcap: float,
                  scale: Optional[float], alibi_slopes=None, sinks=None, bias=None, mask=None,
                  blocks=None) -> Tuple[np.ndarray, np.ndarray]:
    """One sequence: q [Sq, Hq, D], k/v [Sk, Hkv, D] -> o [Sq, Hq, D], lse [Hq, Sq].

    Score modifiers of this sequence, in the contract's order (attention.proto):
    alibi_slopes/sinks [Hq]; bias/mask [Hq or 1, Sq, Sk]; blocks: the element view of its
    block-mask rows, bool [Hq or 1, Sq, Sk].
    """
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes, np.float64)[:, None, None] * np.abs(i - j)[None]
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if mask is not None:
        s = np.where(np.asarray(mask, bool), s, -np.inf)
    if blocks is not None:
        s = np.where(blocks, s, -np.inf)
    visible = np.ones((sq, sk), dtype=bool)
    left, right = window if window is not None else (None, None)
    if left is not None and left >= 0:
        visible &= j >= i - left
    if causal:
        visible &= j <= i
    elif right is not None and right >= 0:
        visible &= j <= i + right
    s = np.where(visible[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if sk else np.full((hq, sq, 1), -np.inf)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[:, None, None]
        m = np.maximum(m, sink)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    total = p.sum(axis=-1, keepdims=True)
    if sink is not None:  # the sink joins the denominator only: O's sum has no sink term
        num = np.einsum("hqk,khd->hqd", p, v)
        total = total + np.exp(sink - m_safe)
        return (num / total).transpose(1, 0, 2), np.log(total[..., 0]) + m_safe[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(total > 0, np.einsum("hqk,khd->hqd", p, v) / np.where(total > 0, total, 1),
                     0.0)
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + m_safe[..., 0], -np.inf)
    return o.transpose(1, 0, 2), lse


def _block_elements(block_mask, b: int, sq: int, sk: int, rows_before: int, rows_total: int):
    """Sequence b's rows of a BlockMask (attnserve.masks) as bool [H or 1, sq, sk]."""
    bq, bk = block_mask.block_q, block_mask.block_k
    qb = -(-sq // bq)
    nh = block_mask.num_heads
    out = np.zeros((nh, sq, sk), dtype=bool)
    for h in range(nh):
        if rows_total is None:  # dense: [num_batch, num_heads, qb]
            first = ((b if block_mask.num_batch > 1 else 0) * nh + h) * qb
        else:  # varlen: [num_heads, all sequences' query blocks]
            first = h * rows_total + rows_before
        for r in range(qb):
            row = first + r
            for c in block_mask.col_idx[block_mask.row_ptr[row]:block_mask.row_ptr[row + 1]]:
                out[h, r * bq:(r + 1) * bq, c * bk:(c + 1) * bk] = True
    return out


def attention(q, k, v, *, causal=False, window=None, softcap=0.0, scale=None,
              cu_seqlens_q: Optional[Sequence[int]] = None,
              cu_seqlens_k: Optional[Sequence[int]] = None, alibi_slopes=None, sinks=None,
              bias=None, mask=None, block_mask=None):
    """Dense [B, S, H, D] or varlen [T, H, D] -> (o float64 like q, lse [B, Hq, Sq] / [Hq, Tq]).

    bias/mask: dense [B or 1, Hq or 1, Sq, Sk], varlen [Hq or 1, P] (attention.proto);
    block_mask: an attnserve.masks.BlockMask."""
    base = dict(causal=causal, window=window, softcap=softcap, scale=scale,
                alibi_slopes=alibi_slopes, sinks=sinks)
    if bias is not None and not isinstance(bias, np.ndarray):
        bias = np.asarray(bias)
    bias = None if bias is None else bias.astype(np.float64)
    if cu_seqlens_q is None:
        def kw(b):
            sq, sk = q.shape[1], k.shape[1]
            pick = lambda t: None if t is None else t[b if t.shape[0] > 1 else 0]
            blocks = (None if block_mask is None
                      else _block_elements(block_mask, b, sq, sk, 0, None))
            return dict(base, bias=pick(bias), mask=pick(mask), blocks=blocks)

        outs = [attention_one(q[b], k[b], v[b], **kw(b)) for b in range(q.shape[0])]
        o = np.stack([x[0] for x in outs]) if outs else np.zeros(q.shape)
        lse = (np.stack([x[1] for x in outs]) if outs
               else np.zeros((0, q.shape[2], q.shape[1])))
        return o, lse
    o = np.zeros(q.shape)
    lse = np.zeros((q.shape[1], q.shape[0]))
    pairs = rows = 0
    batch = len(cu_seqlens_q) - 1
    rows_total = 0 if block_mask is None else sum(
        -(-(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) // block_mask.block_q) for b in range(batch))
    for b in range(batch):
        q0, q1, k0, k1 = cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]
        sq, sk = q1 - q0, k1 - k0
        span = lambda t: None if t is None else t[:, pairs:pairs + sq * sk].reshape(t.shape[0], sq, sk)
        blocks = None
        if block_mask is not None:
            blocks = _block_elements(block_mask, b, sq, sk, rows, rows_total)
            rows += -(-sq // block_mask.block_q)
        o[q0:q1], lse[:, q0:q1] = attention_one(q[q0:q1], k[k0:k1], v[k0:k1], bias=span(bias),
                                                mask=span(mask), blocks=blocks, **base)
        pairs += sq * sk
    return o, lse
