"""append_attend with an element mask and a bias (kv.proto): each sequence's query rows
over its whole history after the append, against reference.py in float64.

Packed sequences of different lengths with per-head masks (a row fully masked: O = 0,
LSE = -inf) and a shared bias, with ALiBi beside them; the dense
[B or 1, Hq or 1, Sq, L] form; refusals naming the argument that change no length.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from attnserve import AttnServeError
from attnserve.kv import Cache

HQ, HKV, D, PAGE = 4, 2, 16, 16
ATOL = 1e-5  # FP32 against float64


def rand(rng, shape):
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


def make_cache(client):
    return Cache(client, num_layers=1, num_heads_kv=HKV, head_dim=D, dtype="float32",
                 capacity_tokens=1 << 12, page_size=PAGE)


def check(o, lse, q, k, v, **mods):
    """One sequence's o [Sq, Hq, D] and lse [Hq, Sq] against the float64 reference
    (non-causal: the mask is the whole pattern)."""
    want_o, want_lse = reference.attention(q[None], k[None], v[None], causal=False, **mods)
    assert np.max(np.abs(o.astype(np.float64) - want_o[0])) <= ATOL * max(1.0, np.abs(want_o).max())
    want_lse = want_lse[0]
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = ~np.isneginf(want_lse)
    assert np.max(np.abs(lse[finite] - want_lse[finite]), initial=0.0) <= 1e-4


def test_packed_masks_and_bias_over_the_history_match_reference(client):
    rng = np.random.default_rng(5)
    with make_cache(client) as cache, cache.sequences(3) as seqs:
        hist_k = [rand(rng, (n, HKV, D)) for n in (40, 3, 17)]
        hist_v = [rand(rng, (n, HKV, D)) for n in (40, 3, 17)]
        cache.append_attend(0, seqs, None, np.concatenate(hist_k), np.concatenate(hist_v),
                            cu_seqlens_k=[0, 40, 43, 60])
        new, nq = [2, 1, 0], [3, 1, 2]  # the last one attends only
        k_new = [rand(rng, (n, HKV, D)) for n in new]
        v_new = [rand(rng, (n, HKV, D)) for n in new]
        q = [rand(rng, (n, HQ, D)) for n in nq]
        after = [h.shape[0] + n for h, n in zip(hist_k, new)]
        masks = [rng.random((HQ, a, b)) < 0.4 for a, b in zip(nq, after)]
        masks[0][1, 2] = False  # a fully masked row
        biases = [rand(rng, (1, a, b)) for a, b in zip(nq, after)]
        slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
        o, lse = cache.append_attend(
            0, seqs, np.concatenate(q), np.concatenate(k_new), np.concatenate(v_new),
            cu_seqlens_q=np.cumsum([0] + nq), cu_seqlens_k=np.cumsum([0] + new), causal=False,
            mask=np.concatenate([m.reshape(HQ, -1) for m in masks], axis=1),
            bias=np.concatenate([b.reshape(1, -1) for b in biases], axis=1),
            alibi_slopes=slopes, return_lse=True)
        assert [s.lengths[0] for s in seqs] == after
        row = 0
        for b in range(3):
            k = np.concatenate([hist_k[b], k_new[b]])
            v = np.concatenate([hist_v[b], v_new[b]])
            check(o[row:row + nq[b]], lse[:, row:row + nq[b]], q[b], k, v,
                  mask=masks[b][None], bias=biases[b][None], alibi_slopes=slopes)
            row += nq[b]
        assert not o[2, 1].any() and np.isneginf(lse[1, 2])  # the fully masked row


def test_dense_mask_form_and_refusals(client):
    rng = np.random.default_rng(6)
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        k, v = rand(rng, (2, 20, HKV, D)), rand(rng, (2, 20, HKV, D))
        q = rand(rng, (2, 20, HQ, D))
        mask = rng.random((2, 1, 20, 20)) < 0.5
        mask[..., 0] = True
        o = cache.append_attend(0, seqs, q, k, v, causal=False, mask=mask)
        for b in range(2):
            want, _ = reference.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask=mask[b:b + 1])
            assert np.max(np.abs(o[b] - want[0])) <= ATOL * max(1.0, np.abs(want).max())
        # The mask matters.
        plain = cache.append_attend(0, seqs, q[:, :1], causal=False)
        assert np.max(np.abs(plain[:, 0] - o[:, 0])) > 1e-2
        # Refusals name the argument (here, before sending) and change no length.
        with pytest.raises(AttnServeError, match=r"mask: expected \[Hq or 1, P\] = \[4 or 1, 42\]"):
            cache.append_attend(0, seqs, q[:, :1], k[:, :1], v[:, :1],
                                mask=np.ones((1, 40), bool))
        with pytest.raises(AttnServeError, match="needs every sequence to have Sq = 1"):
            cache.append_attend(0, seqs, q[:, :1], k[:, :1], v[:, :1],
                                mask=np.ones((2, 1, 1, 20), bool))
        with pytest.raises(AttnServeError, match="not with attend_pages"):
            cache.append_attend(0, seqs, q[:, :1], k[:, :1], v[:, :1],
                                mask=np.ones((1, 42), bool), attend_pages=[[0], None])
        assert [s.lengths[0] for s in seqs] == [20, 20]
