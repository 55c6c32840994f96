"""attnserve.kv against a real CPU server: caches, sequences, append-and-attend, fork,
truncate, stale lengths, NOT_FOUND, errors, the stream, what closing frees, the
affinity header, and the asyncio twin (attnserve.kv_aio), unary and on a stream.

Outputs are checked against the float64 reference over the sequence's whole
history and against a stateless forward() of that history (the paged path
must agree with the contiguous one).
"""

from __future__ import annotations

import asyncio
import re

import grpc
import ml_dtypes
import numpy as np
import pytest

import reference
from attnserve import AsyncClient, AttnServeError
from attnserve.kv import CACHE_ID_HEADER, Cache, Sequence
from attnserve.kv_aio import AsyncCache

LAYERS, HQ, HKV, D = 2, 4, 2, 32
ATOL = {np.float32: 1e-5, ml_dtypes.bfloat16: 3e-2}


def rand(rng, shape, dtype=np.float32):
    return rng.uniform(-1, 1, size=shape).astype(np.float32).astype(dtype)


def tokens(rng, n, dtype=np.float32):
    """q [n, HQ, D] and k, v [n, HKV, D] of n new tokens."""
    return rand(rng, (n, HQ, D), dtype), rand(rng, (n, HKV, D), dtype), rand(rng, (n, HKV, D), dtype)


def make_cache(client, dtype="float32", **kw):
    kw.setdefault("capacity_tokens", 1 << 14)
    return Cache(client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D, dtype=dtype, **kw)


class History:
    """What a sequence holds at one layer, kept here to check against."""

    def __init__(self):
        self.k = np.zeros((0, HKV, D), np.float32)
        self.v = np.zeros((0, HKV, D), np.float32)

    def add(self, k, v):
        self.k = np.concatenate([self.k, k.astype(np.float32)])
        self.v = np.concatenate([self.v, v.astype(np.float32)])

    def copy(self, length=None):
        h = History()
        h.k, h.v = self.k[:length].copy(), self.v[:length].copy()
        return h


def expect_attention(client, o, q, hist, dtype=np.float32):
    """o == causal attention of q over hist (reference within tolerance; forward() exactly)."""
    want, _ = reference.attention(q[None], hist.k[None], hist.v[None], causal=True)
    err = np.max(np.abs(o.astype(np.float64) - want[0]))
    assert err <= ATOL[dtype] * max(1.0, np.max(np.abs(want))), err
    same = client.forward(q[None], hist.k[None].astype(dtype), hist.v[None].astype(dtype),
                          causal=True)[0]
    np.testing.assert_array_equal(o, same)


def test_create_stats_and_drop(client):
    with make_cache(client, page_size=16) as cache:
        s = cache.stats()
        assert s.cache_id == cache.cache_id and cache.cache_id.startswith("py-")
        assert (s.geometry.num_layers, s.geometry.num_heads_kv, s.geometry.head_dim) == (LAYERS, HKV, D)
        assert s.page_size == 16 and s.pages_used == 0 and s.sequences == 0 and s.tokens == 0
        assert s.capacity_pages == (1 << 14) // 16
    with pytest.raises(AttnServeError) as e:  # dropped on exit
        cache.stats()
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    cache.close()  # idempotent: no second DropCache


def test_prefill_then_decode_matches_attention_over_the_history(client):
    rng = np.random.default_rng(1)
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        hist = {(b, layer): History() for b in range(2) for layer in range(LAYERS)}
        # Prefill: dense [B=2, 7, H, D] at each layer.
        for layer in range(LAYERS):
            q, k, v = (rand(rng, (2, 7, h, D)) for h in (HQ, HKV, HKV))
            res = cache.append_attend_result(layer, seqs, q, k, v)
            assert res.o.shape == q.shape and res.lengths == [7, 7]
            for b in range(2):
                hist[b, layer].add(k[b], v[b])
                expect_attention(client, res.o[b], q[b], hist[b, layer])
        assert [s.lengths for s in seqs] == [[7] * LAYERS] * 2
        # Decode: packed, different new-token counts per sequence (2 and 1).
        for step in range(3):
            for layer in range(LAYERS):
                q, k, v = tokens(rng, 3)
                cu = [0, 2, 3]
                o = cache.append_attend(layer, seqs, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
                for b in range(2):
                    hist[b, layer].add(k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]])
                    expect_attention(client, o[cu[b]:cu[b + 1]], q[cu[b]:cu[b + 1]],
                                     hist[b, layer])
        assert [s.lengths for s in seqs] == [[13] * LAYERS, [10] * LAYERS]
        assert cache.server_lengths(seqs) == {seqs[0].id: [13] * LAYERS, seqs[1].id: [10] * LAYERS}
        assert cache.stats().tokens == (13 + 10) * LAYERS


def test_bf16_torch_tensors_and_lse(client):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    with make_cache(client, dtype=torch.bfloat16) as cache, cache.sequence() as seq:
        hist = History()
        q, k, v = tokens(rng, 5, ml_dtypes.bfloat16)
        o, lse = cache.append_attend(0, [seq], *(torch.from_numpy(x.view(np.int16)).view(
            torch.bfloat16) for x in (q, k, v)), return_lse=True)
        assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == (5, HQ, D)
        assert lse.dtype == torch.float32 and lse.shape == (HQ, 5)
        hist.add(k, v)
        o_np = o.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        expect_attention(client, o_np, q, hist, ml_dtypes.bfloat16)


def test_attend_only_and_append_only(client):
    rng = np.random.default_rng(3)
    with make_cache(client) as cache, cache.sequence() as seq:
        hist = History()
        _, k, v = tokens(rng, 4)
        res = cache.append_attend_result(0, [seq], None, k, v)  # append only
        assert res.o is None and res.lengths == [4]
        hist.add(k, v)
        q, _, _ = tokens(rng, 2)
        o = cache.append_attend(0, [seq], q)  # attend only: the last 2 rows of a causal view
        assert seq.lengths == [4, 0]
        expect_attention(client, o, q, hist)


def test_fork_shares_the_prefix_and_diverges(client):
    rng = np.random.default_rng(4)
    with make_cache(client, page_size=16) as cache, cache.sequence() as base:
        hist = History()
        for layer in range(LAYERS):  # a fork prefix must exist at every layer
            q, k, v = tokens(rng, 20)
            cache.append_attend(layer, [base], q, k, v)
            if layer == 0:
                hist.add(k, v)
        used = cache.stats().pages_used  # 2 pages per layer
        assert used == 2 * LAYERS
        with base.fork(18) as child:
            assert child.lengths == [18] * LAYERS
            assert cache.stats().pages_used == used  # shared, nothing copied yet
            q, k, v = tokens(rng, 1)
            o = cache.append_attend(0, [child], q, k, v)
            child_hist = hist.copy(18)
            child_hist.add(k, v)
            expect_attention(client, o, q, child_hist)
            # The shared partial page was copied for the child; base is unchanged.
            assert cache.stats().pages_used == used + 1
            assert cache.server_lengths([base, child]) == {base.id: [20, 20], child.id: [19, 18]}
            q, k, v = tokens(rng, 1)
            o = cache.append_attend(0, [base], q, k, v)
            hist.add(k, v)
            expect_attention(client, o, q, hist)
        assert cache.stats().sequences == 1
        assert cache.stats().pages_used == used  # the child's own page went back


def test_truncate_rolls_back(client):
    rng = np.random.default_rng(5)
    with make_cache(client, page_size=16) as cache, cache.sequence() as seq:
        hist = History()
        for layer in range(LAYERS):
            q, k, v = tokens(rng, 40)
            cache.append_attend(layer, [seq], q, k, v)
            if layer == 0:
                hist.add(k, v)
        pages = cache.stats().pages_used
        seq.truncate(10, layer=0)
        assert seq.lengths == [10, 40]
        assert cache.stats().pages_used == pages - 2  # 40 -> 10 tokens: 3 pages -> 1
        q, k, v = tokens(rng, 1)
        o = cache.append_attend(0, [seq], q, k, v)
        hist = hist.copy(10)
        hist.add(k, v)
        expect_attention(client, o, q, hist)
        seq.truncate(5)  # every layer
        assert seq.lengths == [5, 5] and cache.server_lengths([seq]) == {seq.id: [5, 5]}
        with pytest.raises(AttnServeError) as e:
            seq.truncate(6)  # longer than the sequence
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert seq.lengths == [5, 5]


def test_stale_length_is_refused_and_changes_nothing(client):
    rng = np.random.default_rng(6)
    with make_cache(client) as cache, cache.sequence() as seq:
        q, k, v = tokens(rng, 3)
        call_args = (0, [seq], q, k, v)
        cache.append_attend(*call_args)
        # A retry of a call whose response was lost: the same request again.
        from attnserve.kv import _AppendCall
        seq._lengths[0] = 0  # the client did not see the first one succeed
        again = _AppendCall(cache, *call_args)
        with pytest.raises(AttnServeError) as e:
            cache._call("AppendAttend", again.request)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert re.search(r"\b3\b", e.value.message), e.value.message  # names the actual length
        assert cache.server_lengths([seq]) == {seq.id: [3, 0]}  # nothing appended twice
        # Through the API: the failed call leaves the tracked length as it was.
        seq._lengths[0] = 1
        with pytest.raises(AttnServeError) as e:
            cache.append_attend(*call_args)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert seq.lengths == [1, 0]
        cache.sync([seq])
        assert seq.lengths == [3, 0]
        cache.append_attend(*call_args)
        assert seq.lengths == [6, 0]


def test_not_found(client):
    rng = np.random.default_rng(7)
    with make_cache(client) as cache:
        with cache.sequence() as seq:
            pass
        seq.free()  # already freed: idempotent, no call
        ghost = Sequence(cache, 999, [0] * LAYERS)  # never created on the server
        for call in (lambda: cache.append_attend(0, [ghost], *tokens(rng, 1)),
                     lambda: cache.server_lengths([ghost]),
                     lambda: ghost.truncate(0),
                     lambda: ghost.fork(),
                     lambda: ghost.free()):
            with pytest.raises(AttnServeError) as e:
                call()
            assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value
            assert "999" in e.value.message, e.value.message
        assert ghost.lengths == [0] * LAYERS
    with pytest.raises(AttnServeError) as e:  # the cache is gone
        cache.sequence()
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_invalid_arguments_name_the_field(client):
    rng = np.random.default_rng(8)
    with pytest.raises(AttnServeError) as e:
        Cache(client, num_layers=1, num_heads_kv=2, head_dim=12, dtype="float32",
              capacity_tokens=1024)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "head_dim" in e.value.message
    with make_cache(client) as cache, cache.sequences(2) as seqs:
        before = cache.stats()
        q, k, v = tokens(rng, 3)
        with pytest.raises(AttnServeError) as e:
            cache.append_attend(LAYERS, seqs[:1], q, k, v)  # refused here
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "layer" in e.value.message
        with pytest.raises(AttnServeError) as e:
            cache.append_attend(0, seqs, q, k, v)  # 2 sequences, no cu_seqlens
        assert "cu_seqlens_q" in e.value.message
        with pytest.raises(AttnServeError) as e:  # wrong dtype: the server names it
            cache.append_attend(0, seqs[:1], q.astype(np.float16), k.astype(np.float16),
                                v.astype(np.float16))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in e.value.message
        with pytest.raises(AttnServeError) as e:  # Hkv differs from the cache's
            cache.append_attend(0, seqs[:1], q, rand(rng, (3, 1, D)), rand(rng, (3, 1, D)))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [s.lengths for s in seqs] == [[0, 0], [0, 0]]
        after = cache.stats()
        assert (after.tokens, after.pages_used) == (before.tokens, before.pages_used) == (0, 0)


def test_stream_pipelines_layers_and_steps(client):
    rng = np.random.default_rng(9)
    with make_cache(client) as cache, cache.sequences(3) as seqs:
        hist = {(b, layer): History() for b in range(3) for layer in range(LAYERS)}
        calls = []
        with cache.stream() as stream:
            for step in range(4):  # all steps and layers in flight before any result
                for layer in range(LAYERS):
                    q, k, v = (rand(rng, (3, 2 if step == 0 else 1, h, D)) for h in (HQ, HKV, HKV))
                    calls.append((layer, q, k, v, stream.submit(layer, seqs, q, k, v)))
            # One bad request fails only its own future.
            bad = stream.submit(0, seqs[:1], *tokens(rng, 1), window=(-5, 0))
            for layer, q, k, v, future in calls:
                res = future.result(timeout=120)
                for b in range(3):
                    hist[b, layer].add(k[b], v[b])
                    expect_attention(client, res.o[b], q[b], hist[b, layer])
            with pytest.raises(AttnServeError) as e:
                bad.result(timeout=120)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.request_id
        assert [s.lengths for s in seqs] == [[5, 5]] * 3  # the failed call rolled back
        assert cache.server_lengths(seqs) == {s.id: [5, 5] for s in seqs}


def test_closing_frees_what_it_made(client):
    rng = np.random.default_rng(10)
    with make_cache(client, page_size=16) as cache:
        with cache.sequences(3) as seqs:
            cache.append_attend(0, seqs, *(rand(rng, (3, 20, h, D)) for h in (HQ, HKV, HKV)))
            with seqs[0].fork(0) as child:
                cache.append_attend(0, [child], *tokens(rng, 1))
                s = cache.stats()
                assert s.sequences == 4 and s.pages_used == 3 * 2 + 1
            s = cache.stats()
            assert s.sequences == 3 and s.pages_used == 3 * 2
        s = cache.stats()
        assert s.sequences == 0 and s.pages_used == 0 and s.tokens == 0
        with pytest.raises(RuntimeError):
            with cache.sequence():
                raise RuntimeError("the body failed")
        assert cache.stats().sequences == 0


def test_every_call_carries_the_cache_id_header(client):
    seen = []

    class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            seen.append((details.method, dict(details.metadata or ())))
            return continuation(details, request)

        def intercept_stream_stream(self, continuation, details, requests):
            seen.append((details.method, dict(details.metadata or ())))
            return continuation(details, requests)

    # The client's own stub class (the tensor-carrying methods on attnserve._wire).
    client._kv = type(client._kv)(grpc.intercept_channel(client.channel, Recorder()))
    rng = np.random.default_rng(11)
    with make_cache(client, cache_id="header-test") as cache, cache.sequence() as seq:
        cache.append_attend(0, [seq], *tokens(rng, 2))
        seq.truncate(1, layer=0)
        with seq.fork(0):
            pass
        with cache.stream() as s:
            s.submit(1, [seq], *tokens(rng, 1)).result(timeout=120)
        cache.stats()
    methods = {m.rsplit("/", 1)[1] for m, _ in seen}
    assert methods == {"CreateCache", "CreateSequences", "AppendAttend", "Truncate",
                       "FreeSequences", "AppendAttendStream", "GetCacheStats", "DropCache"}
    assert all(md.get(CACHE_ID_HEADER) == "header-test" for _, md in seen), seen


def test_asyncio_twin(server):
    rng = np.random.default_rng(12)

    async def main():
        async with AsyncClient(server.target) as client:
            cache = await AsyncCache.create(client, num_layers=LAYERS, num_heads_kv=HKV,
                                            head_dim=D, dtype="float32", capacity_tokens=1 << 14)
            async with cache:
                async with await cache.sequences(2) as seqs:
                    hist = [History(), History()]
                    inputs = [tokens(rng, 6), tokens(rng, 3)]
                    # Two sequences in flight at once.
                    outs = await asyncio.gather(*(
                        cache.append_attend(0, [seq], *x) for seq, x in zip(seqs, inputs)))
                    for h, (q, k, v), o in zip(hist, inputs, outs):
                        h.add(k, v)
                        want, _ = reference.attention(q[None], h.k[None], h.v[None], causal=True)
                        assert np.max(np.abs(o - want[0])) <= 1e-5
                    await cache.append_attend(1, [seqs[0]], *tokens(rng, 6))
                    async with await seqs[0].fork(4) as child:
                        assert child.lengths == [4, 4]
                        assert (await cache.stats()).sequences == 3
                    await seqs[0].truncate(6)
                    await seqs[0].truncate(2, layer=0)
                    assert seqs[0].lengths == [2, 6]
                    with pytest.raises(AttnServeError) as e:
                        await seqs[1].truncate(5, layer=0)  # longer than 3
                    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
                    s = await cache.stats()
                    assert s.sequences == 2 and s.tokens == 2 + 6 + 3
                assert (await cache.stats()).sequences == 0
            with pytest.raises(AttnServeError) as e:
                await cache.stats()
            assert e.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


def test_asyncio_stream_generation_loop_equals_unary(server, client):
    """A toy decode loop on AsyncAppendAttendStream (each step's Q/K/V made from the
    last step's O, the three sequences' calls in flight at once, then whole steps
    pipelined) gives bit for bit the outputs of the same loop run with unary calls
    on a second cache; `async with` drops, frees and closes what it made."""
    rng = np.random.default_rng(13)
    batch, prompt, steps = 3, 6, 5
    mix = rand(rng, (HQ * D, (HQ + 2 * HKV) * D)) / 16  # the toy "model": O -> next Q, K, V

    def next_qkv(o):  # a layer's O [n, HQ, D] -> the next one's q [n, HQ, D], k, v [n, HKV, D]
        x = np.tanh(o.reshape(o.shape[0], -1) @ mix)
        q, k, v = np.split(x, [HQ * D, (HQ + HKV) * D], axis=-1)
        n = o.shape[0]
        return q.reshape(n, HQ, D), k.reshape(n, HKV, D), v.reshape(n, HKV, D)

    first = [tokens(rng, prompt) for _ in range(batch)]

    def unary_loop():
        outs = []
        with make_cache(client) as cache, cache.sequences(batch) as seqs:
            x = list(first)
            for step in range(steps):
                for layer in range(LAYERS):
                    o = [cache.append_attend(layer, [seq], *x[b]) for b, seq in enumerate(seqs)]
                    outs.append(o)
                    x = [next_qkv(ob) for ob in o]  # the next layer's input
                x = [tuple(t[-1:] for t in xb) for xb in x]  # the next step: the last token
            lengths = [s.lengths for s in seqs]
        return outs, lengths

    async def stream_loop():
        outs = []
        async with AsyncClient(server.target) as aclient:
            async with AsyncCache.create(aclient, num_layers=LAYERS, num_heads_kv=HKV,
                                         head_dim=D, dtype="float32",
                                         capacity_tokens=1 << 14) as cache, \
                    cache.sequences(batch) as seqs, cache.stream() as stream:
                x = list(first)
                hist = [History() for _ in range(LAYERS)]  # what seqs[0] holds
                for step in range(steps):
                    for layer in range(LAYERS):
                        hist[layer].add(*x[0][1:])
                        futures = [await stream.submit(layer, [seq], *x[b])
                                   for b, seq in enumerate(seqs)]
                        o = [r.o for r in await asyncio.gather(*futures)]
                        outs.append(o)
                        x = [next_qkv(ob) for ob in o]
                    x = [tuple(t[-1:] for t in xb) for xb in x]
                lengths = [s.lengths for s in seqs]
                assert await cache.server_lengths(seqs) == {s.id: s.lengths for s in seqs}

                # Whole steps in flight: 3 steps x 2 layers submitted before any result,
                # then one bad call, which fails alone and rolls its lengths back.
                piped = [(layer, tokens(rng, 1)) for _ in range(3) for layer in range(LAYERS)]
                futures = [await stream.submit(layer, seqs[:1], *x) for layer, x in piped]
                bad = await stream.submit(0, seqs[1:2], *tokens(rng, 1), window=(-5, 0))
                results = await asyncio.gather(*futures)
                assert [r.lengths for r in results] == [
                    [lengths[0][layer] + 1 + i // LAYERS] for i, (layer, _) in enumerate(piped)]
                for (layer, (q, k, v)), r in zip(piped, results):
                    hist[layer].add(k, v)
                    want, _ = reference.attention(q[None], hist[layer].k[None],
                                                  hist[layer].v[None], causal=True)
                    assert np.max(np.abs(r.o - want[0])) <= 1e-5
                with pytest.raises(AttnServeError) as e:
                    await bad
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.request_id
                assert seqs[1].lengths == lengths[1]
                # The stream goes on after the failure.
                o = await stream.append_attend(0, seqs[1:2], *tokens(rng, 1))
                assert o.shape == (1, HQ, D) and seqs[1].lengths[0] == lengths[1][0] + 1
                stats = await cache.stats()
                assert stats.sequences == batch
                cache_id, kept = cache.cache_id, cache
            # Leaving `async with` closed the stream, freed the sequences, dropped the cache.
            assert stream._closed and all(s._freed for s in seqs)
            with pytest.raises(AttnServeError) as e:
                await kept.stats()
            assert e.value.code == grpc.StatusCode.NOT_FOUND, cache_id
        return outs, lengths

    want, want_lengths = unary_loop()
    got, got_lengths = asyncio.run(stream_loop())
    assert got_lengths == want_lengths == [[prompt + steps - 1] * LAYERS] * batch
    assert len(got) == len(want) == steps * LAYERS
    for step_layer, (g, w) in enumerate(zip(got, want)):
        for b in range(batch):
            np.testing.assert_array_equal(g[b], w[b], err_msg=f"call {step_layer}, row {b}")
