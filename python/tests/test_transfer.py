"""attnserve.merge_partials and attnserve.transfer against real CPU servers.

Merge (context parallelism across replicas): a sequence's keys split over two
servers (forward(), and K/V caches), each attended with return_lse, merged and
held to the float64 reference over all the keys (reference.py) with the suites'
tolerances; GQA, bottom-right causal over split keys, an empty partial, torch.

Transfer: a cache moved between two servers (move_cache), exported to chunks and
imported again (export_sequences/import_sequences, Cache.export_to), a cut
stream resumed without resending finished sequences, and refusals; the moved
cache attends exactly as the original did.
"""

from __future__ import annotations

import os

import grpc
import ml_dtypes
import numpy as np
import pytest

import conftest
import reference
from attnserve import AttnServeError, Client, merge_partials
from attnserve.kv import Cache

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
ATOL = {"fp32": 1e-5, "fp16": 4e-3, "bf16": 3e-2}


def rand(rng, shape, dtype=np.float32):
    return rng.uniform(-1, 1, size=shape).astype(np.float32).astype(dtype)


def check(out, ref, dtype_name):
    assert out.shape == ref.shape
    err = float(np.max(np.abs(out.astype(np.float64) - ref), initial=0.0))
    assert err <= ATOL[dtype_name] * max(1.0, float(np.max(np.abs(ref), initial=0))), err


def check_lse(lse, ref_lse):
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.all(lse[~finite] == -np.inf)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def server_b():
    """A second CPU server (the suites' own binary); with $ATTNSERVE_TARGET and no
    binary, the tests that need two servers skip."""
    binary = os.environ.get("ATTNSERVE_SERVER", "")
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("a second server needs $ATTNSERVE_SERVER (the attnserve binary)")
    s = conftest.Server(binary, [])
    yield s
    s.stop()


@pytest.fixture
def client_b(server_b):
    with Client(server_b.target) as c:
        yield c


# -- merge without a server ----------------------------------------------------------------
def test_merge_weights_by_exp_lse():
    o0 = np.array([[[1.0, 0.0]]], np.float32)  # [S 1, H 1, D 2]
    o1 = np.array([[[0.0, 2.0]]], np.float32)
    o, lse = merge_partials([o0, o1], [np.zeros((1, 1), np.float32),
                                       np.full((1, 1), np.log(3.0), np.float32)])
    np.testing.assert_allclose(o, [[[0.25, 1.5]]], rtol=1e-6)
    np.testing.assert_allclose(lse, [[np.log(4.0)]], rtol=1e-6)
    assert o.dtype == np.float32 and lse.dtype == np.float32


def test_merge_empty_partials_and_rows():
    nan, inf = np.nan, np.inf
    # Row 0: only partial 1 saw keys (partial 0's O is NaN there and never read);
    # row 1: no partial saw a key.
    o0 = np.array([[[nan, nan]], [[0, 0]]], np.float16)
    o1 = np.array([[[0.5, -1.0]], [[0, 0]]], np.float16)
    l0 = np.array([[-inf, -inf]], np.float32)
    l1 = np.array([[1.25, -inf]], np.float32)
    o, lse = merge_partials([o0, o1], [l0, l1])
    assert o.dtype == np.float16
    np.testing.assert_array_equal(o, [[[0.5, -1.0]], [[0, 0]]])
    np.testing.assert_array_equal(lse, [[1.25, -inf]])
    o, lse = merge_partials([o0], [l0], out_dtype=ml_dtypes.bfloat16)
    assert o.dtype == ml_dtypes.bfloat16 and np.all(o.astype(np.float32) == 0)
    assert np.all(lse == -inf)


def test_merge_torch_matches_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    outs = [rand(rng, (2, 5, 4, 8)) for _ in range(3)]
    lses = [rand(rng, (2, 4, 5)) * 4 for _ in range(3)]
    lses[1][0, 1, 2] = -np.inf
    want_o, want_lse = merge_partials(outs, lses)
    o, lse = merge_partials([torch.from_numpy(x).to(torch.bfloat16) for x in outs],
                            [torch.from_numpy(x) for x in lses])
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    np.testing.assert_allclose(o.float().numpy(), want_o, atol=8e-3)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-6)
    o, _ = merge_partials([torch.from_numpy(x) for x in outs],
                          [torch.from_numpy(x) for x in lses], out_dtype=torch.float16)
    assert o.dtype == torch.float16


@pytest.mark.parametrize("outs, lses, field", [
    ([], [], "partials: expected at least one"),
    ([np.zeros((2, 3, 4), np.float32)] * 2, [np.zeros((3, 2), np.float32)],
     "one lse per o, got 2 o and 1 lse"),
    ([np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 8), np.float32)],
     [np.zeros((3, 2), np.float32)] * 2, "partials[1].o.shape"),
    ([np.zeros((2, 3, 4), np.float32)], [np.zeros((2, 3), np.float32)], "partials[0].lse.shape"),
    ([np.zeros((3, 4), np.float32)], [np.zeros((3,), np.float32)], "partials[0].o.shape"),
    ([np.zeros((1, 1, 4), np.float32)] * 2, [np.zeros((1, 1), np.float32),
                                             np.full((1, 1), np.nan, np.float32)],
     "partials[1].lse"),
])
def test_merge_refusals_name_the_field(outs, lses, field):
    with pytest.raises(AttnServeError) as e:
        merge_partials(outs, lses)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.message


# -- context parallelism: keys split over two servers --------------------------------------
def partial_window(causal, sk, end):
    """The options a partial over keys [begin, end) of Sk takes so its keys are masked as
    in the whole sequence (bottom-right causal): causal for the last piece, else a right
    window of Sk - end."""
    if not causal:
        return {}
    return dict(causal=True) if end == sk else dict(window=(None, sk - end))


CASES = [
    # (b, sq, sk, hq, hkv, d, causal, cuts)
    (2, 17, 97, 4, 4, 64, False, [40]),
    (1, 33, 160, 8, 2, 64, False, [64]),      # GQA 4:1
    (1, 1, 200, 8, 2, 128, True, [130]),      # decode, causal, GQA
    (2, 5, 70, 4, 1, 32, True, [20, 60]),     # three partials, MQA
    (1, 64, 64, 4, 2, 64, True, [24]),        # causal prefill: early rows see no key of B
    (1, 9, 48, 4, 2, 64, False, [0]),         # an empty partial (no keys)
    (1, 9, 48, 4, 2, 64, True, [48]),         # empty last partial, causal
]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}q{c[1]}k{c[2]}h{c[3]}:{c[4]}"
                         + ("-causal" if c[6] else "") + "-cuts" + ",".join(map(str, c[7])))
def test_forward_split_over_two_servers(client, client_b, dtype_name, case):
    b, sq, sk, hq, hkv, d, causal, cuts = case
    rng = np.random.default_rng(sum(case[:6]) + len(cuts))
    dt = DTYPES[dtype_name]
    q, k, v = rand(rng, (b, sq, hq, d), dt), rand(rng, (b, sk, hkv, d), dt), rand(rng, (b, sk, hkv, d), dt)
    bounds = [0, *cuts, sk]
    outs, lses = [], []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        c = (client, client_b)[i % 2]
        o, lse = c.forward(q, k[:, lo:hi], v[:, lo:hi], return_lse=True,
                           **partial_window(causal, sk, hi))
        outs.append(o)
        lses.append(lse)
    o, lse = merge_partials(outs, lses)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
    assert o.dtype == np.dtype(dt)
    check(o, ref_o, dtype_name)
    check_lse(lse, ref_lse)


def test_merging_one_partial_alone_fails_the_check(client):
    """The check above can fail: half the keys are not the whole."""
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, (1, 4, 4, 64)), rand(rng, (1, 64, 2, 64)), rand(rng, (1, 64, 2, 64))
    o, lse = client.forward(q, k[:, :32], v[:, :32], return_lse=True)
    o, lse = merge_partials([o], [lse])
    with pytest.raises(AssertionError):
        check(o, reference.attention(q, k, v)[0], "fp32")


def test_torch_split_over_two_servers(client, client_b):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    q, k, v = rand(rng, (1, 8, 8, 64)), rand(rng, (1, 120, 2, 64)), rand(rng, (1, 120, 2, 64))
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    a = client.forward(tq, tk[:, :50], tv[:, :50], return_lse=True, window=(None, 70))
    b = client_b.forward(tq, tk[:, 50:], tv[:, 50:], return_lse=True, causal=True)
    o, lse = merge_partials([a[0], b[0]], [a[1], b[1]])
    assert o.dtype == torch.bfloat16 and tuple(o.shape) == (1, 8, 8, 64)
    ref_o, ref_lse = reference.attention(tq.float().numpy(), tk.float().numpy(),
                                         tv.float().numpy(), causal=True)
    check(o.float().numpy(), ref_o, "bf16")
    check_lse(lse.numpy(), ref_lse)


@pytest.mark.parametrize("dtype_name", ["fp32", "fp16"])
def test_kv_caches_on_two_servers_decode_as_one(client, client_b, dtype_name):
    """A sequence's first tokens in a cache on one server, the rest on the other: each
    decode step attends both (the newest part causal), merged == attention over all."""
    rng = np.random.default_rng(5)
    dt = DTYPES[dtype_name]
    hq, hkv, d, split, total, steps = 8, 2, 64, 96, 150, 3
    k, v = rand(rng, (total + steps, hkv, d), dt), rand(rng, (total + steps, hkv, d), dt)
    kw = dict(num_layers=1, num_heads_kv=hkv, head_dim=d, dtype=dt, capacity_tokens=1024,
              page_size=16)
    with Cache(client, **kw) as a, Cache(client_b, **kw) as b, \
            a.sequences([7]) as sa, b.sequences([7]) as sb:
        a.append_attend(0, sa, None, k[:split], v[:split])
        b.append_attend(0, sb, None, k[split:total], v[split:total])
        for t in range(steps):  # the new token goes to the newest part
            n = total + t
            q = rand(rng, (1, hq, d), dt)
            oa, la = a.append_attend(0, sa, q, None, None, causal=False, return_lse=True)
            ob, lb = b.append_attend(0, sb, q, k[n:n + 1], v[n:n + 1], causal=True,
                                     return_lse=True)
            o, lse = merge_partials([oa, ob], [la, lb])
            ref_o, ref_lse = reference.attention(q, k[:n + 1], v[:n + 1], causal=True,
                                                 cu_seqlens_q=[0, 1], cu_seqlens_k=[0, n + 1])
            check(o, ref_o, dtype_name)
            check_lse(lse, ref_lse)


# -- transfer: moving a cache between two servers ------------------------------------------
from attnserve import transfer  # noqa: E402
from attnserve.kv import Sequence  # noqa: E402
from attnserve.v1 import kv_transfer_pb2 as tpb  # noqa: E402

LAYERS, HQ, HKV, D = 2, 4, 2, 32
# Each sequence's length per layer: a page boundary crossed, one exactly full, a short one.
LENGTHS = {1: 40, 2: 16, 5: 3}


def make_source(client, cache_id, dtype=np.float32, page_size=16):
    """A cache on `client`'s server holding LENGTHS' sequences, each layer's K/V random;
    returns it and the K/V by (sequence, layer)."""
    rng = np.random.default_rng(17)
    cache = Cache(client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D, dtype=dtype,
                  capacity_tokens=1 << 12, page_size=page_size, cache_id=cache_id)
    seqs = cache.sequences(list(LENGTHS))
    kv = {}
    for s in seqs:
        for layer in range(LAYERS):
            n = LENGTHS[s.id]
            k, v = rand(rng, (n, HKV, D), dtype), rand(rng, (n, HKV, D), dtype)
            cache.append_attend(layer, [s], None, k, v)
            kv[s.id, layer] = (k, v)
    return cache, kv


def attach(client, cache_id, dtype, ids=tuple(LENGTHS)):
    """A Cache object for a cache the server holds (made by an import) and its sequences
    `ids`, lengths read back from the server (Cache's constructor would create it)."""
    cache = Cache.__new__(Cache)
    cache._init(client, LAYERS, HKV, D, dtype, 1, None, 0, cache_id, None, False, None)
    stats = cache.stats()
    cache.num_layers, cache.page_size, cache.device = (stats.geometry.num_layers,
                                                       stats.page_size, stats.device)
    seqs = [Sequence(cache, i, None) for i in ids]
    for s in seqs:
        cache._sequences[s.id] = s
    cache.sync(seqs)
    return cache


def attend_all(cache, ids, dtype=np.float32):
    """Attend-only O and LSE of one fixed query per (sequence, layer)."""
    rng = np.random.default_rng(23)
    out = {}
    for s in [cache._sequences[i] for i in ids]:
        for layer in range(LAYERS):
            q = rand(rng, (1, HQ, D), dtype)
            out[s.id, layer] = cache.append_attend(layer, [s], q, causal=False, return_lse=True)
    return out


def expect_same_attention(src, dst, ids, dtype=np.float32):
    a, b = attend_all(src, ids, dtype), attend_all(dst, ids, dtype)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key][0], b[key][0], err_msg=str(key))
        np.testing.assert_array_equal(a[key][1], b[key][1], err_msg=str(key))


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_move_cache_attends_identically(client, client_b, dtype_name):
    dt = DTYPES[dtype_name]
    src, kv = make_source(client, f"mv-{dtype_name}", dt)
    seen = []
    r = transfer.move_cache(client, client_b, src.cache_id, capacity_tokens=1 << 12,
                            max_chunk_bytes=16 * HKV * D * np.dtype(dt).itemsize,
                            progress=lambda sent, total, live: seen.append((sent, total, live)))
    assert sorted(r.sequence_ids) == sorted(LENGTHS) and r.resumes == 0 and r.bytes_resent == 0
    itemsize = np.dtype(dt).itemsize
    assert r.bytes == 2 * LAYERS * sum(LENGTHS.values()) * HKV * D * itemsize
    assert seen[-1][0] == seen[-1][1] == r.bytes  # progress reached the header's total
    assert r.stats.cache_id == src.cache_id and r.stats.sequences == len(LENGTHS)
    dst = attach(client_b, src.cache_id, dt)
    seqs = [dst._sequences[i] for i in LENGTHS]
    assert {s.id: s.lengths for s in seqs} == {i: [n] * LAYERS for i, n in LENGTHS.items()}
    expect_same_attention(src, dst, list(LENGTHS), dt)
    # And the moved K/V are the ones appended: attention over them is the reference's.
    rng = np.random.default_rng(3)
    q = rand(rng, (1, HQ, D), dt)
    k, v = kv[1, 1]
    o = dst.append_attend(1, [seqs[0]], q, causal=False)
    check(o, reference.attention(q[None], k[None], v[None])[0][0], dtype_name)
    src.close()
    dst.close()



def test_prefill_hands_over_in_pieces(client, client_b):
    """token_end then token_begin: the receiver holds the first 16 tokens of two
    sequences, then the rest of one is appended; it attends as the source does."""
    src, _ = make_source(client, "pieces")
    ids = [2, 1]  # sending order
    r = transfer.move_cache(client, client_b, "pieces", sequence_ids=ids, token_end=16,
                            capacity_tokens=1 << 12)
    assert r.sequence_ids == ids
    dst = attach(client_b, "pieces", np.float32, ids)
    assert [dst._sequences[i].lengths for i in ids] == [[16, 16], [16, 16]]
    transfer.move_cache(client, client_b, "pieces", sequence_ids=[1], token_begin=16)
    dst.sync([dst._sequences[1]])
    assert dst._sequences[1].lengths == [40, 40]
    expect_same_attention(src, dst, [1])
    src.close()
    dst.close()


def test_a_cut_stream_resumes_without_resending_finished_sequences(client, client_b):
    src, _ = make_source(client, "cut")
    chunk_bytes = 16 * HKV * D * 4
    opened = []

    def flaky(resume, transfer_id):
        """The export, cut after 5 chunks the first time (UNAVAILABLE, as a dropped
        connection), whole from the resume point the second time."""
        opened.append(resume)
        stream = transfer.export_sequences(client, "cut", transfer_id=transfer_id,
                                           resume=resume, max_chunk_bytes=chunk_bytes)
        for i, chunk in enumerate(stream):
            if resume is None and i == 5:
                stream.cancel()
                raise AttnServeError(grpc.StatusCode.UNAVAILABLE, "cut for the test")
            yield chunk

    r = transfer.push_chunks(client_b, "cut", flaky, capacity_tokens=1 << 12)
    assert r.resumes == 1 and len(opened) == 2 and opened[0] is None
    # Sequence 1 (40 tokens: 3 one-page chunks a layer) was cut after its 5th chunk: the
    # receiver holds layer 0 and 32 rows of layer 1, and says so.
    point = opened[1]
    assert list(point.committed_sequence_ids) == [] and point.sequence_id == 1
    assert (point.layer, point.token) == (1, 32)
    total = 2 * LAYERS * sum(LENGTHS.values()) * HKV * D * 4
    assert r.bytes == total and r.bytes_resent == 0  # nothing sent twice
    assert sorted(r.sequence_ids) == sorted(LENGTHS)
    dst = attach(client_b, "cut", np.float32)
    expect_same_attention(src, dst, list(LENGTHS))
    src.close()
    dst.close()


def test_a_failed_move_continues_with_its_transfer_id(client, client_b):
    src, _ = make_source(client, "again")
    chunk_bytes = 16 * HKV * D * 4

    def cut_after_first_sequence(resume, transfer_id):
        for chunk in transfer.export_sequences(client, "again", transfer_id=transfer_id,
                                               max_chunk_bytes=chunk_bytes):
            yield chunk
            if chunk.sequence_end:
                raise AttnServeError(grpc.StatusCode.UNAVAILABLE, "cut for the test")

    with pytest.raises(AttnServeError) as e:
        transfer.push_chunks(client_b, "again", cut_after_first_sequence, transfer_id="t-again",
                             capacity_tokens=1 << 12, max_resumes=0)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # Sequence 1 is live on the receiver already; the same id continues after it.
    r = transfer.move_cache(client, client_b, "again", transfer_id="t-again")
    assert r.transfer_id == "t-again" and sorted(r.sequence_ids) == sorted(LENGTHS)
    assert r.bytes == 2 * LAYERS * (LENGTHS[2] + LENGTHS[5]) * HKV * D * 4
    dst = attach(client_b, "again", np.float32)
    expect_same_attention(src, dst, list(LENGTHS))
    src.close()
    dst.close()


def test_snapshot_file_round_trip(client, client_b, tmp_path):
    src, _ = make_source(client, "snap", ml_dtypes.bfloat16)
    path = str(tmp_path / "snap.chunks")
    n = transfer.export_file(client, "snap", path, max_chunk_bytes=16 * HKV * D * 2)
    header = transfer.check_chunk_file(path)
    assert n == len(list(transfer.read_chunks(path))) and n > len(LENGTHS) * LAYERS
    assert [s.sequence_id for s in header.sequences] == sorted(LENGTHS)
    r = transfer.import_file(client_b, path, "snap-copy", capacity_tokens=1 << 12)
    assert sorted(r.sequence_ids) == sorted(LENGTHS) and r.stats.cache_id == "snap-copy"
    dst = attach(client_b, "snap-copy", ml_dtypes.bfloat16)
    expect_same_attention(src, dst, list(LENGTHS), ml_dtypes.bfloat16)
    # The same file again into a cache that holds those ids: refused, nothing changed.
    with pytest.raises(AttnServeError) as e:
        transfer.import_file(client_b, path, "snap-copy")
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert dst.stats().sequences == len(LENGTHS)
    src.close()
    dst.close()


def test_damaged_and_cut_files_are_refused_naming_the_chunk(client, client_b, tmp_path):
    src, _ = make_source(client, "dmg")
    path = str(tmp_path / "dmg.chunks")
    transfer.export_file(client, "dmg", path, max_chunk_bytes=16 * HKV * D * 4)
    data = bytearray(open(path, "rb").read())
    bad = tmp_path / "flipped.chunks"
    flipped = data.copy()
    flipped[len(flipped) // 2] ^= 0x40  # inside some chunk's k or v bytes
    bad.write_bytes(bytes(flipped))
    with pytest.raises(AttnServeError) as e:
        transfer.import_file(client_b, str(bad), "dmg-copy", capacity_tokens=1 << 12)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "crc32c mismatch" in e.value.message or "do not parse" in e.value.message
    cut = tmp_path / "cut.chunks"
    cut.write_bytes(bytes(data[:-7]))
    with pytest.raises(AttnServeError) as e:
        transfer.import_file(client_b, str(cut), "dmg-copy", capacity_tokens=1 << 12)
    assert "bytes inside a" in e.value.message and "chunk" in e.value.message
    with pytest.raises(AttnServeError) as e:  # nothing was sent: no cache made
        attach_stats_only(client_b, "dmg-copy").stats()
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    src.close()


def attach_stats_only(client, cache_id):
    cache = Cache.__new__(Cache)
    cache._init(client, LAYERS, HKV, D, np.float32, 1, None, 0, cache_id, None, False, None)
    return cache


def test_refusals(client, client_b):
    src, _ = make_source(client, "ref")
    # No cache on the receiver and nothing to create it with.
    with pytest.raises(AttnServeError) as e:
        transfer.move_cache(client, client_b, "ref", dest_cache_id="ref-missing")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    # A receiving cache of another geometry.
    with Cache(client_b, num_layers=LAYERS, num_heads_kv=HKV, head_dim=64, dtype="float32",
               capacity_tokens=1 << 12, cache_id="ref-other") as other:
        with pytest.raises(AttnServeError) as e:
            transfer.move_cache(client, client_b, "ref", dest_cache_id=other.cache_id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert other.stats().sequences == 0
    # An unknown source sequence: NOT_FOUND before anything is sent.
    with pytest.raises(AttnServeError) as e:
        transfer.move_cache(client, client_b, "ref", sequence_ids=[99], capacity_tokens=1 << 12)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(AttnServeError) as e:
        transfer.move_cache(client, client_b, "ref", capacity_tokens=1 << 12, capacity_bytes=1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "capacity_tokens" in e.value.message
    src.close()


def test_chunk_file_format_is_delimited_kvchunks(tmp_path):
    """The file is protobuf's delimited form, readable without attnserve."""
    from google.protobuf.internal.decoder import _DecodeVarint32
    chunk = tpb.KvChunk(sequence_id=3, layer=1, num_tokens=1, k=b"ab", v=b"cd")
    chunk.crc32c = transfer.chunk_crc32c(chunk)
    chunk.header.total_bytes = 4
    path = str(tmp_path / "one.chunks")
    assert transfer.write_chunks(path, [chunk]) == 1
    data = open(path, "rb").read()
    n, pos = _DecodeVarint32(data, 0)
    assert tpb.KvChunk.FromString(data[pos:pos + n]) == chunk and pos + n == len(data)
    assert list(transfer.read_chunks(path)) == [chunk]
    # The checksum is CRC-32C (Castagnoli): the published check value.
    from attnserve._crc32c import crc32c
    assert crc32c(b"123456789") == 0xE3069283


def test_a_cut_file_import_resumes_by_skipping_what_the_receiver_holds(client, client_b,
                                                                       tmp_path):
    src, _ = make_source(client, "fcut")
    path = str(tmp_path / "fcut.chunks")
    transfer.export_file(client, "fcut", path, max_chunk_bytes=16 * HKV * D * 4)
    opened = []

    def flaky(resume, transfer_id):
        """import_file's chunk source, cut after 7 chunks the first time."""
        opened.append(resume)
        for i, chunk in enumerate(transfer.skip_received(transfer.read_chunks(path), resume,
                                                         transfer_id)):
            if resume is None and i == 7:
                raise AttnServeError(grpc.StatusCode.UNAVAILABLE, "cut for the test")
            yield chunk

    r = transfer.push_chunks(client_b, "fcut-copy", flaky, capacity_tokens=1 << 12)
    # Sequence 1 took 6 chunks (3 a layer), so sequence 2 (1 a layer) was cut after its first.
    assert r.resumes == 1 and list(opened[1].committed_sequence_ids) == [1]
    assert (opened[1].sequence_id, opened[1].layer, opened[1].token) == (2, 1, 0)
    assert r.bytes_resent == 0 and sorted(r.sequence_ids) == sorted(LENGTHS)
    dst = attach(client_b, "fcut-copy", np.float32)
    expect_same_attention(src, dst, list(LENGTHS))
    src.close()
    dst.close()


def test_skip_received_cuts_a_chunk_the_receiver_holds_part_of():
    """A resume point inside a chunk (another chunking than the receiver saw): the rows
    it holds are cut off and the checksum computed again."""
    rows = [bytes([t]) * 4 for t in range(8)]  # 8 tokens of 4 bytes
    header = tpb.KvTransferHeader(transfer_id="old", total_bytes=64)
    chunks = []
    for begin in (0, 4):
        c = tpb.KvChunk(sequence_id=9, layer=0, token_begin=begin, num_tokens=4,
                        k=b"".join(rows[begin:begin + 4]), v=b"".join(rows[begin:begin + 4]),
                        sequence_end=begin == 4)
        c.crc32c = transfer.chunk_crc32c(c)
        chunks.append(c)
    chunks[0].header.CopyFrom(header)
    point = tpb.ImportResumePoint(sequence_id=9, layer=0, token=6)
    out = list(transfer.skip_received(chunks, point, "new"))
    assert len(out) == 1 and out[0].header.transfer_id == "new"
    assert (out[0].token_begin, out[0].num_tokens) == (6, 2) and out[0].k == rows[6] + rows[7]
    assert out[0].crc32c == transfer.chunk_crc32c(out[0]) and out[0].sequence_end
    # Committed sequences are skipped whole.
    assert list(transfer.skip_received(chunks, tpb.ImportResumePoint(
        committed_sequence_ids=[9]), "new")) == []


def test_cache_export_to_a_server_and_a_file(client, client_b, tmp_path):
    src, _ = make_source(client, "exp")
    r = src.export_to(client_b, cache_id="exp-copy", sequences=[src._sequences[5]],
                      capacity_tokens=1 << 12)
    assert r.sequence_ids == [5] and r.stats.cache_id == "exp-copy"
    path = tmp_path / "exp.chunks"
    assert src.export_to(path) == len(list(transfer.read_chunks(str(path))))
    assert [s.sequence_id for s in transfer.check_chunk_file(str(path)).sequences] == \
        sorted(LENGTHS)
    dst = attach(client_b, "exp-copy", np.float32, [5])
    expect_same_attention(src, dst, [5])
    src.close()
    dst.close()


def test_a_cache_without_sequences_has_nothing_to_move(client, client_b):
    with Cache(client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D, dtype="float32",
               capacity_tokens=1 << 12, cache_id="none-live"):
        with pytest.raises(AttnServeError) as e:
            transfer.move_cache(client, client_b, "none-live", capacity_tokens=1 << 12)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "no live sequences" in e.value.message
