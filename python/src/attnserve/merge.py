"""The exact merge of partial attention results over disjoint key sets (context parallelism).

    from attnserve import merge_partials
    o_a, lse_a = client_a.forward(q, k[:, :n], v[:, :n], return_lse=True)
    o_b, lse_b = client_b.forward(q, k[:, n:], v[:, n:], return_lse=True)
    o, lse = merge_partials([o_a, o_b], [lse_a, lse_b])   # == attention over all of k, v

Each partial attended the queries over its own keys and returned O_i and
LSE_i (return_lse=True). Over the union of the keys (the FlashAttention
paper's rescaling):

    LSE = log sum_i exp(LSE_i)        O = sum_i exp(LSE_i - LSE) * O_i

with the largest LSE_i subtracted before any exp, accumulated in float32. A row
a partial saw no key for (LSE_i = -inf) takes nothing from that partial, whatever
its O_i holds; a row no partial saw a key for is O = 0, LSE = -inf, as the server
answers it. The same function as the C++ client's MergeAttentionPartials
(client/lse_merge.h).

Masks: give each partial the rule the whole sequence has over its keys. For
bottom-right causal over Sk keys split into [a, b) pieces, the piece holding the
last keys is causal, and a piece ending at b < Sk takes window=(None, Sk - b)
(non-causal; the right window aligns it to the whole sequence). Sinks go to one
partial only (each one with sinks adds the sink's term to the denominator).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from attnserve import _tensors
from attnserve.errors import invalid_argument


def _lse_shape(o_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """O [..., S, H, D] -> LSE [..., H, S]."""
    return tuple(o_shape[:-3]) + (o_shape[-2], o_shape[-3])


def _check(outs: Sequence[Any], lses: Sequence[Any]) -> None:
    if len(outs) == 0:
        raise invalid_argument("partials: expected at least one, got 0")
    if len(outs) != len(lses):
        raise invalid_argument(f"partials: expected one lse per o, got {len(outs)} o and "
                               f"{len(lses)} lse")
    torch_in = [_tensors.is_torch(x) for x in list(outs) + list(lses)]
    if any(torch_in) and not all(torch_in):
        raise invalid_argument("partials: expected all NumPy arrays or all torch tensors, "
                               "got a mix")
    shape = tuple(outs[0].shape)
    if len(shape) < 3:
        raise invalid_argument(f"partials[0].o.shape: expected [..., S, H, D] (rank >= 3), "
                               f"got {list(shape)}")
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape:
            raise invalid_argument(f"partials[{i}].o.shape: expected {list(shape)} "
                                   f"(partials[0].o), got {list(o.shape)}")
        if tuple(lse.shape) != _lse_shape(shape):
            raise invalid_argument(f"partials[{i}].lse.shape: expected "
                                   f"{list(_lse_shape(shape))} (o is {list(shape)}), got "
                                   f"{list(lse.shape)}")


def _bad_lse(i: int, lse: Any) -> None:
    raise invalid_argument(f"partials[{i}].lse: expected finite values or -inf, got "
                           f"{lse} (NaN or +inf)")


def _merge_numpy(outs, lses, out_dtype):
    lse = np.stack([np.asarray(x, dtype=np.float32) for x in lses])  # [n, ..., H, S]
    for i in range(len(lses)):
        bad = np.isnan(lse[i]) | (lse[i] == np.inf)
        if bad.any():
            _bad_lse(i, lse[i][bad][0])
    m = lse.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, np.float32(0))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        w = np.where(lse == -np.inf, np.float32(0), np.exp(lse - m_safe))
        total = w.sum(axis=0)  # >= 1 where any partial saw a key
        out_lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1)),
                           np.float32(-np.inf)).astype(np.float32)
        w = w / np.where(total > 0, total, 1)
        acc = np.zeros(outs[0].shape, np.float32)
        for i, o in enumerate(outs):
            wi = np.swapaxes(w[i], -1, -2)[..., None]  # [..., S, H, 1]
            acc += np.where(wi > 0, wi * np.asarray(o).astype(np.float32), np.float32(0))
    dtype = np.asarray(outs[0]).dtype if out_dtype is None else np.dtype(out_dtype)
    return acc.astype(dtype), out_lse


def _merge_torch(outs, lses, out_dtype):
    import torch
    lse = torch.stack([x.to(torch.float32) for x in lses])
    for i in range(len(lses)):
        bad = torch.isnan(lse[i]) | (lse[i] == math.inf)
        if bool(bad.any()):
            _bad_lse(i, float(lse[i][bad][0]))
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    empty = lse == -math.inf
    w = torch.where(empty, torch.zeros_like(lse), torch.exp(lse - m_safe))
    total = w.sum(dim=0)
    seen = total > 0
    ones = torch.ones_like(total)
    out_lse = torch.where(seen, m_safe + torch.log(torch.where(seen, total, ones)),
                          torch.full_like(total, -math.inf))
    w = w / torch.where(seen, total, ones)
    acc = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for i, o in enumerate(outs):
        wi = w[i].transpose(-1, -2).unsqueeze(-1)
        acc += torch.where(wi > 0, wi * o.to(torch.float32), torch.zeros_like(wi))
    return acc.to(outs[0].dtype if out_dtype is None else out_dtype), out_lse


def merge_partials(outs: Sequence[Any], lses: Sequence[Any], *,
                   out_dtype: Optional[Any] = None) -> Tuple[Any, Any]:
    """Merges partial results over disjoint key sets into attention over all the keys.

    Args:
      outs: each partial's O, [..., S, H, D]: a forward()'s dense [B, Sq, Hq, D] or
        varlen [Tq, Hq, D], an append_attend()'s [B, Sq, Hq, D] or [T, Hq, D];
        float16, bfloat16 or float32 (they may differ), all NumPy or all torch
        (one device).
      lses: each partial's LSE (return_lse=True), [..., H, S]: [B, Hq, Sq] or [Hq, T]
        (append_attend()'s [Hq, B * Sq] with a dense O is taken as its packed form).
      out_dtype: O's dtype (a NumPy or torch dtype); None: the first partial's.

    Returns:
      (o, lse): o like outs[0] (in out_dtype), lse float32 like lses[0].

    Raises:
      AttnServeError (INVALID_ARGUMENT) naming the partial and the field for shapes
      that disagree, no partials, a NumPy/torch mix, or an LSE that is NaN or +inf.
    """
    outs, lses = list(outs), list(lses)
    shape = None
    if outs and lses and len(outs[0].shape) > 3 and len(lses[0].shape) == 2:
        # append_attend()'s dense O [B, Sq, Hq, D] comes with the K/V LSE [Hq, B * Sq]:
        # merged as the packed [B * Sq, Hq, D] it is on the wire.
        shape = tuple(outs[0].shape)
        outs = [o.reshape(-1, *shape[-2:]) for o in outs]
    _check(outs, lses)
    merge = _merge_torch if _tensors.is_torch(outs[0]) else _merge_numpy
    o, lse = merge(outs, lses, out_dtype)
    return (o if shape is None else o.reshape(shape)), lse
