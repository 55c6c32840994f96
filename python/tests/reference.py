"""A float64 NumPy reference of attention with the contract's masking rules (DESIGN.md §2)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np


def attention_one(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool,
                  window: Optional[Tuple[Optional[int], Optional[int]]], softcap: float,
                  scale: Optional[float]) -> Tuple[np.ndarray, np.ndarray]:
    """One sequence: q [Sq, Hq, D], k/v [Sk, Hkv, D] -> o [Sq, Hq, D], lse [Hq, Sq]."""
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
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    total = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(total > 0, np.einsum("hqk,khd->hqd", p, v) / np.where(total > 0, total, 1),
                     0.0)
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + m_safe[..., 0], -np.inf)
    return o.transpose(1, 0, 2), lse


def attention(q, k, v, *, causal=False, window=None, softcap=0.0, scale=None,
              cu_seqlens_q: Optional[Sequence[int]] = None,
              cu_seqlens_k: Optional[Sequence[int]] = None):
    """Dense [B, S, H, D] or varlen [T, H, D] -> (o float64 like q, lse [B, Hq, Sq] / [Hq, Tq])."""
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    if cu_seqlens_q is None:
        outs = [attention_one(q[b], k[b], v[b], **kw) for b in range(q.shape[0])]
        o = np.stack([x[0] for x in outs]) if outs else np.zeros(q.shape)
        lse = (np.stack([x[1] for x in outs]) if outs
               else np.zeros((0, q.shape[2], q.shape[1])))
        return o, lse
    o = np.zeros(q.shape)
    lse = np.zeros((q.shape[1], q.shape[0]))
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]
        o[q0:q1], lse[:, q0:q1] = attention_one(q[q0:q1], k[k0:k1], v[k0:k1], **kw)
    return o, lse
