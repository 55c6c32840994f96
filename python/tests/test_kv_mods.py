"""attnserve.kv's score modifiers and page-level sparsity against a real CPU server.

append_attend with alibi_slopes and sinks over a prefill and several decode steps
(unary, on the stream, and asyncio) equals the float64 reference (reference.py, which
applies them) over all the K/V appended so far; with attend_pages it equals the
reference over exactly the attended pages' tokens plus the new ones. Refusals (slope
or sink counts, ALiBi or a window with attend_pages, bad page indices) name the
argument, and the sequences' lengths, tracked and on the server, stay as they were.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

import reference
from attnserve import AsyncClient, AttnServeError, _mods
from attnserve.kv import Cache
from attnserve.kv_aio import AsyncCache

LAYERS, HQ, HKV, D, PAGE = 2, 4, 2, 16, 16
ATOL = 1e-5  # FP32 against float64
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
SINKS = np.array([1.5, -1.0, 0.5, 3.0], np.float32)


def rand(rng, shape):
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


def make_cache(client, **kw):
    return Cache(client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D, dtype="float32",
                 capacity_tokens=1 << 13, page_size=PAGE, **kw)


class History:
    """Each (sequence, layer)'s K/V as appended, to attend over here."""

    def __init__(self, batch):
        self.k = {(b, l): np.zeros((0, HKV, D), np.float32)
                  for b in range(batch) for l in range(LAYERS)}
        self.v = dict(self.k)

    def add(self, b, layer, k, v):
        self.k[b, layer] = np.concatenate([self.k[b, layer], k])
        self.v[b, layer] = np.concatenate([self.v[b, layer], v])


def expect(o, q, k, v, **mods):
    """o [Sq, Hq, D] == causal attention of q over k/v [Sk, Hkv, D] with mods (float64)."""
    want, _ = reference.attention(q[None], k[None], v[None], causal=True, **mods)
    err = np.max(np.abs(o.astype(np.float64) - want[0]))
    assert err <= ATOL * max(1.0, np.max(np.abs(want))), err


def step_tensors(rng, batch, n):
    """q [batch, n, HQ, D] and k, v [batch, n, HKV, D]."""
    return tuple(rand(rng, (batch, n, h, D)) for h in (HQ, HKV, HKV))


def test_alibi_and_sinks_over_decode_steps_match_reference(client):
    rng = np.random.default_rng(21)
    mods = dict(alibi_slopes=SLOPES, sinks=SINKS)
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        hist = History(2)
        for step, n in enumerate([19, 1, 1, 2, 1]):  # a prefill over two pages, then decode
            for layer in range(LAYERS):
                q, k, v = step_tensors(rng, 2, n)
                o = cache.append_attend(layer, seqs, q, k, v, **mods)
                for b in range(2):
                    hist.add(b, layer, k[b], v[b])
                    expect(o[b], q[b], hist.k[b, layer], hist.v[b, layer], **mods)
        assert [s.lengths for s in seqs] == [[24] * LAYERS] * 2
        # The mods matter: the same call without them answers otherwise.
        q, k, v = step_tensors(rng, 2, 1)
        with_mods = cache.append_attend(0, seqs, q, k, v, **mods)
        plain = cache.append_attend(1, seqs, q, k, v)
        assert np.max(np.abs(with_mods - plain)) > 1e-2


def test_mods_as_torch_packed_sequences_and_lse(client):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(22)
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        hist = History(2)
        for cu in ([0, 5, 12], [0, 1, 2], [0, 2, 3]):  # different counts per sequence
            q, k, v = rand(rng, (cu[-1], HQ, D)), rand(rng, (cu[-1], HKV, D)), rand(
                rng, (cu[-1], HKV, D))
            o, lse = cache.append_attend(0, seqs, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                         alibi_slopes=torch.from_numpy(SLOPES),
                                         sinks=torch.from_numpy(SINKS).double(),
                                         return_lse=True)
            for b in range(2):
                rows = slice(cu[b], cu[b + 1])
                hist.add(b, 0, k[rows], v[rows])
                expect(o[rows], q[rows], hist.k[b, 0], hist.v[b, 0], alibi_slopes=SLOPES,
                       sinks=SINKS)
                _, want_lse = reference.attention(q[rows][None], hist.k[b, 0][None],
                                                  hist.v[b, 0][None], causal=True,
                                                  alibi_slopes=SLOPES, sinks=SINKS)
                np.testing.assert_allclose(lse[:, rows], want_lse[0], atol=1e-5)


def test_stream_with_different_mods_in_flight(client):
    rng = np.random.default_rng(23)
    variants = [dict(), dict(sinks=SINKS), dict(alibi_slopes=SLOPES),
                dict(alibi_slopes=SLOPES[::-1].copy(), sinks=-SINKS)]
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        hist = History(2)
        calls = []
        with cache.stream() as stream:
            for step in range(4):  # every step and layer in flight before any result
                for layer in range(LAYERS):
                    mods = variants[(step + layer) % len(variants)]
                    q, k, v = step_tensors(rng, 2, 9 if step == 0 else 1)
                    calls.append((layer, q, k, v, mods,
                                  stream.submit(layer, seqs, q, k, v, **mods)))
            for layer, q, k, v, mods, future in calls:
                o = future.result(timeout=120).o
                for b in range(2):
                    hist.add(b, layer, k[b], v[b])
                    expect(o[b], q[b], hist.k[b, layer], hist.v[b, layer], **mods)


def test_asyncio_unary_and_stream(server):
    rng = np.random.default_rng(24)
    mods = dict(alibi_slopes=SLOPES, sinks=SINKS)

    async def main():
        async with AsyncClient(server.target) as client, \
                AsyncCache.create(client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D,
                                  dtype="float32", capacity_tokens=1 << 13,
                                  page_size=PAGE) as cache, \
                cache.sequences(1) as seqs, cache.stream() as stream:
            hist = History(1)
            for n in (34, 1, 1):
                q, k, v = step_tensors(rng, 1, n)
                o = await cache.append_attend(0, seqs, q, k, v, **mods)
                hist.add(0, 0, k[0], v[0])
                expect(o[0], q[0], hist.k[0, 0], hist.v[0, 0], **mods)
                q, k, v = step_tensors(rng, 1, n)
                o = await stream.append_attend(1, seqs, q, k, v, **mods)
                hist.add(0, 1, k[0], v[0])
                expect(o[0], q[0], hist.k[0, 1], hist.v[0, 1], **mods)
            # attend_pages on the asyncio stream: page 0 and the new token's page (2).
            q, k, v = step_tensors(rng, 1, 1)
            length = seqs[0].length(1)
            o = await stream.append_attend(1, seqs, q, k, v, sinks=SINKS, attend_pages=[[0]])
            hist.add(0, 1, k[0], v[0])
            keys = attended(length, 1, [0])
            assert keys.size < length + 1
            expect(o[0], q[0], hist.k[0, 1][keys], hist.v[0, 1][keys], sinks=SINKS)

    asyncio.run(main())


def attended(length, new, pages):
    """Token indices a step attends: the named history pages (those below the first
    page holding a new token) and the tokens from that page on (kv-cache.md)."""
    if new == 0:
        return np.concatenate([np.arange(p * PAGE, min((p + 1) * PAGE, length)) for p in pages])
    first_new = length // PAGE
    named = [np.arange(p * PAGE, (p + 1) * PAGE) for p in pages if p < first_new]
    return np.concatenate(named + [np.arange(first_new * PAGE, length + new)])


def test_attend_pages_match_reference_over_the_attended_tokens(client):
    rng = np.random.default_rng(25)
    with make_cache(client) as cache, cache.sequences(3) as seqs:
        hist = History(3)
        q, k, v = step_tensors(rng, 3, 70)  # pages 0..4, the last one partial (6 tokens)
        cache.append_attend(0, seqs, q, k, v)
        for b in range(3):
            hist.add(b, 0, k[b], v[b])
        cases = [
            # (per-sequence attend_pages, new tokens, queries, sinks)
            ([[0, 2], [1, 3, 4], None], 1, 1, None),
            ([[4], [0], [1, 2]], 1, 1, SINKS),       # the partial page named: kept once
            ([[0, 3], None, [2]], 2, 3, SINKS),      # speculative: 2 tokens, 3 queries
            ([[0, 1, 2], [3], [0]], 12, 12, None),   # the new tokens fill a page and spill
        ]
        for pages, new, nq, sinks in cases:
            lengths = [s.length(0) for s in seqs]
            q = rand(rng, (3, nq, HQ, D))
            _, k, v = step_tensors(rng, 3, new)
            cu_q, cu_k = [0, nq, 2 * nq, 3 * nq], [0, new, 2 * new, 3 * new]
            o = cache.append_attend(0, seqs, q.reshape(-1, HQ, D), k.reshape(-1, HKV, D),
                                    v.reshape(-1, HKV, D), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    sinks=sinks, attend_pages=pages).reshape(q.shape)
            for b in range(3):
                hist.add(b, 0, k[b], v[b])
                keys = (np.arange(lengths[b] + new) if pages[b] is None
                        else attended(lengths[b], new, pages[b]))
                expect(o[b], q[b], hist.k[b, 0][keys], hist.v[b, 0][keys],
                       sinks=sinks)
                if pages[b] is not None:  # leaving pages out changes the answer
                    full, _ = reference.attention(q[b][None], hist.k[b, 0][None],
                                                  hist.v[b, 0][None], causal=True, sinks=sinks)
                    assert np.max(np.abs(o[b] - full[0])) > 1e-3
        # Attend only (no new tokens): exactly the named pages, a partial one included.
        length = seqs[0].length(0)
        q = rand(rng, (1, 1, HQ, D))
        o = cache.append_attend(0, seqs[:1], q, attend_pages=[[1, length // PAGE]],
                                causal=False)
        expect(o[0], q[0], *(x[0, 0][attended(length, 0, [1, length // PAGE])]
                             for x in (hist.k, hist.v)))
        assert [s.lengths for s in seqs] == [[length, 0]] * 3  # whole sequences grew


def expect_refused(cache, seqs, match, args, **kw):
    """cache.append_attend(*args, **kw) raises INVALID_ARGUMENT with `match` in its
    message, changing no length of `seqs` (tracked here or on the server)."""
    before = [s.lengths for s in seqs]
    server = cache.server_lengths(seqs)
    with pytest.raises(AttnServeError) as e:
        cache.append_attend(*args, **kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert match in e.value.message, e.value.message
    assert [s.lengths for s in seqs] == before
    assert cache.server_lengths(seqs) == server
    return e.value.message


def test_refusals_name_the_argument_and_change_nothing(client):
    rng = np.random.default_rng(26)
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        q, k, v = step_tensors(rng, 2, 40)  # 3 pages, the last partial
        cache.append_attend(0, seqs, q, k, v)
        q, k, v = step_tensors(rng, 2, 1)

        def refused(match, args=(0, seqs, q, k, v), **kw):
            return expect_refused(cache, seqs, match, args, **kw)

        refused("alibi_slopes: expected one value per query head, shape (4,)",
                alibi_slopes=SLOPES[:3])
        refused("sinks: expected one value per query head", sinks=np.ones((2, HQ), np.float32))
        refused("sinks[2] must be finite", sinks=np.array([0, 0, np.inf, 0], np.float32))
        refused("alibi_slopes: expected one value per query head (without q, a positive "
                "multiple of Hkv = 2)", (0, seqs, None, k, v), alibi_slopes=SLOPES[:3])
        refused("attend_pages[1]: not supported with alibi_slopes", alibi_slopes=SLOPES,
                attend_pages=[None, [0]])
        refused("attend_pages[0]: not supported with a window", window=(8, 0),
                attend_pages=[[0], None])
        refused("attend_pages: expected 2 entries (one per sequence), got 1", attend_pages=[[0]])
        refused("attend_pages[0]: expected a list of integer page indices",
                attend_pages=[[0.5], None])
        msg = refused("attend_pages[1]: expected strictly increasing page indices in [0, 3)",
                      attend_pages=[[0], [0, 3]])
        assert "attend_pages[1][1] = 3" in msg and f"sequence {seqs[1].id}" in msg
        refused("attend_pages[0][1] = 1 after 2", attend_pages=[[2, 1], None])
        refused("attend_pages[0][0] = -1", attend_pages=[[-1], None])
        refused("attend_pages[0]: with causal, expected at most the new tokens + 1 = 2 queries",
                (0, seqs[:1], rand(rng, (1, 3, HQ, D)), k[:1], v[:1]), attend_pages=[[0]])
        with cache.sequence() as empty:  # an empty history has no pages to name
            expect_refused(cache, [empty], "attend_pages[0]: expected strictly increasing "
                           "page indices in [0, 0)", (0, [empty], q[:1], k[:1], v[:1]),
                           attend_pages=[[0]])


def test_server_refusals_name_the_field(client, monkeypatch):
    """The same mistakes past the client's checks: the server names its fields and
    appends nothing."""
    rng = np.random.default_rng(27)
    monkeypatch.setattr(_mods, "check_pages", lambda *a: None)
    monkeypatch.setattr("attnserve.kv._check_sparse", lambda *a: None)
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        q, k, v = step_tensors(rng, 2, 40)
        cache.append_attend(0, seqs, q, k, v)
        q, k, v = step_tensors(rng, 2, 1)
        call = (0, seqs, q, k, v)
        expect_refused(cache, seqs, "sequences[1].attend_pages", call,
                       attend_pages=[None, [0, 3]])
        expect_refused(cache, seqs, "alibi_slopes", call, alibi_slopes=SLOPES,
                       attend_pages=[[0], None])
