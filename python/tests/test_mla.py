"""MLA shapes from Python against a real CPU server: forward() with V's head dim
differing from Q's and K's (DeepSeek-V3 prefill, 192 / 128; the absorbed decode
form, 576 / 512), and attnserve.kv caches with a value head dim, including V
inside K's pages (v_in_k), checked against the float64 reference over the
sequence's whole history."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import reference
from attnserve import AttnServeError
from attnserve.kv import Cache


def rand(rng, shape):
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


@pytest.mark.parametrize("d,dv,hq,hkv", [(192, 128, 4, 2), (576, 512, 16, 1), (64, 128, 2, 2)])
def test_forward_value_head_dim(client, d, dv, hq, hkv):
    rng = np.random.default_rng(d + dv)
    q, k, v = rand(rng, (2, 9, hq, d)), rand(rng, (2, 33, hkv, d)), rand(rng, (2, 33, hkv, dv))
    o, lse = client.forward(q, k, v, causal=True, return_lse=True)
    assert o.shape == (2, 9, hq, dv)
    want_o, want_lse = reference.attention(q, k, v, causal=True)
    assert np.max(np.abs(o - want_o)) <= 1e-5 * max(1.0, np.max(np.abs(want_o)))
    assert np.max(np.abs(lse - want_lse)) <= 1e-4


def test_forward_refuses_a_value_head_dim_out_of_range(client):
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (1, 2, 2, 192)), rand(rng, (1, 3, 2, 192)), rand(rng, (1, 3, 2, 520))
    with pytest.raises(AttnServeError) as e:
        client.forward(q, k, v)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "v.shape[3]" in str(e.value)


@pytest.mark.parametrize("d,dv,hq,hkv,v_in_k", [(576, 512, 16, 1, True), (192, 128, 4, 2, False)])
def test_cache_with_a_value_head_dim(client, d, dv, hq, hkv, v_in_k):
    rng = np.random.default_rng(7)
    with Cache(client, num_layers=1, num_heads_kv=hkv, head_dim=d, head_dim_v=dv,
               v_in_k=v_in_k, dtype="float32", capacity_tokens=1024, page_size=16) as cache, \
            cache.sequences(1) as seqs:
        stats = cache.stats()
        assert (stats.geometry.head_dim_v, stats.geometry.v_in_k) == (dv, v_in_k)
        assert stats.page_bytes == 16 * hkv * (d if v_in_k else d + dv) * 4
        hist_k = np.zeros((0, hkv, d), np.float32)
        hist_v = np.zeros((0, hkv, dv), np.float32)
        for n in (20, 1, 1, 5):
            q, k = rand(rng, (1, n, hq, d)), rand(rng, (1, n, hkv, d))
            v = None if v_in_k else rand(rng, (1, n, hkv, dv))
            o = cache.append_attend(0, seqs, q, k, v, causal=True)
            assert o.shape == (1, n, hq, dv)
            hist_k = np.concatenate([hist_k, k[0]])
            hist_v = np.concatenate([hist_v, k[0][..., :dv] if v_in_k else v[0]])
            want, _ = reference.attention(q, hist_k[None], hist_v[None], causal=True)
            assert np.max(np.abs(o - want)) <= 1e-5 * max(1.0, np.max(np.abs(want)))
