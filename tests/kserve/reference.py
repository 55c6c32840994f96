# A float64 NumPy reference of attnserve's attention (DESIGN.md §2 semantics:
# bottom-right aligned causal mask and windows, softcap, GQA, varlen), for the
# tritonclient tests to compare against.
import numpy as np


def attention(q, k, v, causal=False, window_left=None, window_right=None, softcap=0.0,
              softmax_scale=None):
    """Dense q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D] -> (o [B,Sq,Hq,D], lse [B,Hq,Sq])."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / np.sqrt(d)
    group = hq // hkv
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    visible = np.ones((sq, sk), bool)
    right = 0 if causal else window_right
    if right is not None:
        visible &= j <= i + right
    if window_left is not None:
        visible &= j >= i - window_left
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    lse = np.where(total[..., 0] > 0, np.log(np.maximum(total[..., 0], 1e-300)) + m[..., 0],
                   -np.inf)
    o = np.einsum("bhij,bjhd->bihd", p / np.where(total > 0, total, 1.0), v)
    return o, lse


def varlen_attention(q, k, v, cu_q, cu_k, **options):
    """Packed q [Tq,Hq,D], k/v [Tk,Hkv,D] -> (o [Tq,Hq,D], lse [Hq,Tq])."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        o, lse = attention(q[None, cu_q[i]:cu_q[i + 1]], k[None, cu_k[i]:cu_k[i + 1]],
                           v[None, cu_k[i]:cu_k[i + 1]], **options)
        outs.append(o[0])
        lses.append(lse[0])
    return np.concatenate(outs), np.concatenate(lses, axis=1)
