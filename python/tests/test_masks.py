"""Score modifiers and masks: attnserve.masks' builders (no server), the request's encoding
against the generated class, client-side refusals, and every kind end to end against a real
CPU server, checked against reference.py's float64 attention with the same modifiers."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import reference
from attnserve import AttnServeError, _request
from attnserve.masks import (BlockMask, alibi_slopes, element_mask_from_flex,
                             random_block_mask, stripes_block_mask)
from attnserve.v1 import attention_pb2 as pb

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


# -- builders (no server) ----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 1, 3, 2), (2, 1, 1, 1), (1, 4, 2, 7)])
def test_from_dense_round_trip(shape):
    rng = np.random.default_rng(sum(shape))
    blocks = rng.random(shape) < 0.4
    blocks[0, 0, 0] = False  # an empty row
    bm = BlockMask.from_dense(blocks)
    assert (bm.num_batch, bm.num_heads) == shape[:2]
    assert bm.num_rows == shape[0] * shape[1] * shape[2]
    assert bm.kept == int(blocks.sum())
    assert np.array_equal(bm.to_dense(shape[3]), blocks)
    assert bm.row_ptr.dtype == np.int32 and bm.col_idx.dtype == np.int32


def test_from_sequences_rows_are_head_major():
    seq0 = np.array([[[1, 0], [1, 1]]], dtype=bool).repeat(2, axis=0)  # [H=2, 2, 2]
    seq1 = np.array([[[0, 1, 1]]], dtype=bool).repeat(2, axis=0)       # [H=2, 1, 3]
    seq1[1, 0, 2] = False
    bm = BlockMask.from_sequences([seq0, seq1], block_q=256)
    assert (bm.block_q, bm.block_k, bm.num_batch, bm.num_heads) == (256, 128, 2, 2)
    # rows: h0: seq0 r0, seq0 r1, seq1 r0; h1: the same
    assert bm.row_ptr.tolist() == [0, 1, 3, 5, 6, 8, 9]
    assert bm.col_idx.tolist() == [0, 0, 1, 1, 2, 0, 0, 1, 1]


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_q=100), "block_q"),
    (dict(block_k=0), "block_k"),
    (dict(row_ptr=[1, 2]), "row_ptr"),
    (dict(row_ptr=[0, 2, 1, 3]), "non-decreasing"),
    (dict(row_ptr=[0, 2]), r"len\(col_idx\)"),
    (dict(col_idx=[1, 1, 2]), "increase strictly"),
    (dict(col_idx=[0, -1, 2]), "negative"),
    (dict(num_heads=0), "num_heads"),
    (dict(col_idx=[0.5, 1, 2]), "integers"),
])
def test_block_mask_refuses_malformed(kwargs, field):
    args = dict(block_q=128, block_k=128, num_batch=1, num_heads=1, row_ptr=[0, 2, 3],
                col_idx=[0, 1, 2])
    args.update(kwargs)
    with pytest.raises(AttnServeError, match=field):
        BlockMask(**args)


def test_block_mask_accepts_a_new_row_at_a_lower_column():
    bm = BlockMask(128, 128, 1, 1, [0, 2, 2, 4], [3, 5, 0, 1])  # empty row in the middle
    assert bm.kept == 4


def paper_slopes(n):
    """The ALiBi paper's get_slopes, as published."""
    def pow2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + paper_slopes(2 * closest)[0::2][:n - closest]


@pytest.mark.parametrize("n", [1, 2, 5, 8, 12, 16, 24, 40, 64])
def test_alibi_slopes_are_the_papers(n):
    got = alibi_slopes(n)
    assert got.dtype == np.float32 and got.shape == (n,)
    np.testing.assert_allclose(got, np.float32(paper_slopes(n)), rtol=1e-7)
    if n == 8:
        assert got.tolist() == [2.0 ** -(i + 1) for i in range(8)]


@pytest.mark.parametrize("density", [0.0, 0.25, 0.5, 1.0])
def test_patterns_keep_the_fraction(density):
    for bm in (random_block_mask(1024, 2048, density, batch=2, heads=3, seed=1),
               stripes_block_mask(1024, 2048, density, batch=2, heads=3)):
        assert bm.num_rows == 2 * 3 * 8
        assert bm.kept == 2 * 3 * 8 * int(math.floor(density * 16 + 0.5))
    stripes = stripes_block_mask(1024, 1024, 0.5).to_dense(8)[0, 0]
    assert stripes[:, :1].all()                            # global column 0
    assert all(stripes[r, r] for r in range(8))            # the diagonal
    assert not stripes[0, 7] and not stripes[7, 4]         # outside band and globals


def test_varlen_pattern_rows():
    bm = random_block_mask(0, 0, 0.5, heads=2, cu_seqlens_q=[0, 200, 200, 500],
                           cu_seqlens_k=[0, 300, 400, 410], seed=3)
    # per head: 2 + 0 + 3 query blocks
    assert (bm.num_batch, bm.num_heads, bm.num_rows) == (3, 2, 10)


# -- FlexAttention (torch) -----------------------------------------------------------------
def flex():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    try:
        from torch.nn.attention import flex_attention
    except ImportError as e:
        pytest.skip(f"this torch has no FlexAttention: {e}")
    return torch, flex_attention


def test_from_flex_block_aligned_is_exact():
    torch, fa = flex()

    def block_causal(b, h, q_idx, kv_idx):
        return (q_idx // 128) >= (kv_idx // 128)

    fbm = fa.create_block_mask(block_causal, None, None, 512, 640, device="cpu")
    bm = BlockMask.from_flex(fbm, require_exact=True)
    want = np.tril(np.ones((4, 5), dtype=bool))
    assert np.array_equal(bm.to_dense(5)[0, 0], want)
    # The element mask agrees with the blocks exactly.
    elems = element_mask_from_flex(fbm)
    assert elems.shape == (1, 1, 512, 640)
    assert np.array_equal(elems[0, 0], np.kron(want, np.ones((128, 128), dtype=bool)))


def test_from_flex_partial_blocks_keep_both_lists_and_say_so():
    torch, fa = flex()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    fbm = fa.create_block_mask(causal, 2, 1, 384, 384, device="cpu")
    bm = BlockMask.from_flex(fbm)
    assert (bm.num_batch, bm.num_heads) == (2, 1)
    # Diagonal blocks are partial, those below full: both kept.
    assert np.array_equal(bm.to_dense(3)[1, 0], np.tril(np.ones((3, 3), dtype=bool)))
    with pytest.raises(AttnServeError, match="partial blocks"):
        BlockMask.from_flex(fbm, require_exact=True)
    elems = element_mask_from_flex(fbm, batch=None, heads=None)
    assert np.array_equal(elems[0, 0], np.tril(np.ones((384, 384), dtype=bool)))


def test_from_flex_refuses_small_blocks():
    torch, fa = flex()
    fbm = fa.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu",
                               BLOCK_SIZE=64)
    with pytest.raises(AttnServeError, match="multiple of 128"):
        BlockMask.from_flex(fbm)


# -- the request (no server) ------------------------------------------------------------------
def test_request_matches_the_generated_class():
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (2, 130, 4, 8)), rand(rng, (2, 260, 2, 8)), rand(rng, (2, 260, 2, 8))
    bias = rand(rng, (1, 4, 130, 260), ml_dtypes.bfloat16)
    mask = rng.random((2, 1, 130, 260)) < 0.5
    bm = random_block_mask(130, 260, 0.5, batch=2, heads=4, seed=1)
    enc = _request.build_request(q, k, v, causal=True, request_id="r1", alibi_slopes=alibi_slopes(4),
                                 sinks=[0.5, 0, -1, 2], bias=bias, mask=mask, block_mask=bm)
    want = pb.ForwardRequest(request_id="r1")
    for x, t in ((q, want.q), (k, want.k), (v, want.v)):
        t.dtype, t.data = pb.FP32, x.tobytes()
        t.shape.extend(x.shape)
    want.options.causal = True
    want.options.alibi_slopes.extend(alibi_slopes(4).tolist())
    want.options.sinks.extend([0.5, 0, -1, 2])
    want.options.bias.dtype = pb.BF16
    want.options.bias.shape.extend(bias.shape)
    want.options.bias.data = bias.tobytes()
    want.options.mask.shape.extend(mask.shape)
    want.options.mask.data = mask.astype(np.uint8).tobytes()
    m = want.options.block_mask
    m.block_q, m.block_k, m.num_batch, m.num_heads = 128, 128, 2, 4
    m.row_ptr.extend(bm.row_ptr.tolist())
    m.col_idx.extend(bm.col_idx.tolist())
    parsed = pb.ForwardRequest.FromString(enc.data)
    assert parsed == want


@pytest.mark.parametrize("kwargs, match", [
    (dict(alibi_slopes=[1.0, 2.0]), r"alibi_slopes: expected one value per query head, shape \(4,\)"),
    (dict(sinks=[0, 0, np.inf, 0]), r"sinks\[2\] must be finite"),
    (dict(bias=np.zeros((2, 4, 16, 24), np.float64)), "bias.dtype"),
    (dict(bias=np.zeros((2, 3, 16, 24), np.float32)), r"bias: dense calls take \[B or 1, Hq or 1"),
    (dict(bias=np.zeros((4, 16, 24), np.float32)), "bias: dense"),
    (dict(mask=np.zeros((1, 1, 16, 24), np.float32)), "mask.dtype"),
    (dict(mask=np.zeros((1, 1, 16, 25), bool)), r"mask: dense calls take"),
    (dict(block_mask="dense"), "expected an attnserve.masks.BlockMask"),
    (dict(block_mask=random_block_mask(16, 24, 1.0, batch=2, heads=3)), "block_mask.num_heads"),
    (dict(block_mask=random_block_mask(16, 24, 1.0, batch=3, heads=4)), "block_mask.num_batch"),
    (dict(block_mask=random_block_mask(300, 24, 1.0, batch=2, heads=4)), "rows"),
    (dict(block_mask=BlockMask(128, 128, 1, 1, [0, 1], [1])), r"col_idx\[0\] = 1 \(row 0\)"),
])
def test_client_refuses_before_sending(kwargs, match):
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (2, 16, 4, 8)), rand(rng, (2, 24, 2, 8)), rand(rng, (2, 24, 2, 8))
    with pytest.raises(AttnServeError, match=match) as e:
        _request.build_request(q, k, v, **kwargs)
    assert e.value.code.name == "INVALID_ARGUMENT"


def test_client_refuses_varlen_shapes():
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (20, 2, 8)), rand(rng, (30, 2, 8)), rand(rng, (30, 2, 8))
    cu = dict(cu_seqlens_q=[0, 5, 20], cu_seqlens_k=[0, 10, 30])
    _request.build_request(q, k, v, bias=np.zeros((2, 5 * 10 + 15 * 20), np.float32), **cu)
    with pytest.raises(AttnServeError, match=r"varlen calls take \[Hq or 1, P\] = \[2 or 1, 350\]"):
        _request.build_request(q, k, v, mask=np.zeros((1, 349), bool), **cu)
    with pytest.raises(AttnServeError, match="one per sequence"):
        _request.build_request(q, k, v, block_mask=random_block_mask(20, 30, 1.0), **cu)


# -- end to end (CPU server) ------------------------------------------------------------------
def dense_inputs(rng, b, sq, sk, hq, hkv, d, dt):
    return rand(rng, (b, sq, hq, d), dt), rand(rng, (b, sk, hkv, d), dt), rand(rng, (b, sk, hkv, d), dt)


def run(client, dtype_name, q, k, v, **kw):
    o, lse = client.forward(q, k, v, return_lse=True, **kw)
    ref_o, ref_lse = reference.attention(q, k, v, **kw)
    check(o, ref_o, dtype_name)
    check_lse(lse, ref_lse)
    return o, lse


def mods_for(kind, rng, b, sq, sk, hq):
    if kind == "alibi":
        return dict(alibi_slopes=alibi_slopes(hq))
    if kind == "sinks":
        return dict(sinks=rng.uniform(-2, 2, hq).astype(np.float32))
    if kind == "bias":
        return dict(bias=rand(rng, (b, hq, sq, sk)) * 2)
    if kind == "bias_shared_bf16":
        return dict(bias=rand(rng, (1, 1, sq, sk), ml_dtypes.bfloat16) * 2)
    if kind == "mask":
        return dict(mask=rng.random((b, 1, sq, sk)) < 0.6)
    if kind == "block_random":
        return dict(block_mask=random_block_mask(sq, sk, 0.5, batch=b, heads=hq, seed=2))
    if kind == "block_stripes_shared":
        return dict(block_mask=stripes_block_mask(sq, sk, 0.4, block_k=256))
    if kind == "all":
        bias = rand(rng, (1, hq, sq, sk))
        bias[0, 0, :, :5] = -np.inf  # -inf removes keys like the mask
        return dict(alibi_slopes=alibi_slopes(hq), sinks=np.full(hq, 0.25, np.float32),
                    bias=bias, mask=rng.random((b, hq, sq, sk)) < 0.8,
                    block_mask=random_block_mask(sq, sk, 0.6, batch=b, heads=hq, seed=5))
    raise ValueError(kind)


KINDS = ["alibi", "sinks", "bias", "bias_shared_bf16", "mask", "block_random",
         "block_stripes_shared", "all"]


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_dense_end_to_end(client, kind, dtype_name):
    rng = np.random.default_rng(KINDS.index(kind))
    b, sq, sk, hq, hkv, d = 2, 200, 300, 4, 2, 32
    q, k, v = dense_inputs(rng, b, sq, sk, hq, hkv, d, DTYPES[dtype_name])
    run(client, dtype_name, q, k, v, **mods_for(kind, rng, b, sq, sk, hq))
    run(client, dtype_name, q, k, v, causal=True, softcap=3.0,
        **mods_for(kind, rng, b, sq, sk, hq))


@pytest.mark.parametrize("kind", ["bias", "mask", "block", "all"])
def test_varlen_end_to_end(client, kind):
    rng = np.random.default_rng(7)
    lq, lk, hq, hkv, d = [130, 0, 260], [200, 50, 129], 2, 1, 16
    cu_q, cu_k = np.cumsum([0] + lq).tolist(), np.cumsum([0] + lk).tolist()
    q, k, v = rand(rng, (cu_q[-1], hq, d)), rand(rng, (cu_k[-1], hkv, d)), rand(rng, (cu_k[-1], hkv, d))
    pairs = sum(a * b for a, b in zip(lq, lk))
    mods = {}
    if kind in ("bias", "all"):
        mods["bias"] = rand(rng, (hq, pairs)) * 2
    if kind in ("mask", "all"):
        mods["mask"] = rng.random((1, pairs)) < 0.5
    if kind in ("block", "all"):
        mods["block_mask"] = random_block_mask(0, 0, 0.5, heads=hq, cu_seqlens_q=cu_q,
                                               cu_seqlens_k=cu_k, seed=4)
    if kind == "all":
        mods.update(alibi_slopes=alibi_slopes(hq), sinks=[1.0, -1.0])
    run(client, "fp32", q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window=(100, 20), **mods)


def test_fully_masked_rows(client):
    rng = np.random.default_rng(11)
    q, k, v = dense_inputs(rng, 1, 256, 256, 2, 2, 16, np.float32)
    blocks = np.ones((1, 1, 2, 2), dtype=bool)
    blocks[0, 0, 1] = False  # query block 1 sees nothing
    bm = BlockMask.from_dense(blocks)
    o, lse = run(client, "fp32", q, k, v, block_mask=bm)
    assert np.all(o[0, 128:] == 0) and np.all(lse[0, :, 128:] == -np.inf)
    o, lse = run(client, "fp32", q, k, v, block_mask=bm, sinks=[0.5, -0.5])
    assert np.all(o[0, 128:] == 0)
    assert np.all(lse[0, 0, 128:] == np.float32(0.5)) and np.all(lse[0, 1, 128:] == np.float32(-0.5))


def test_torch_tensors_and_flex_end_to_end(client):
    torch, fa = flex()
    rng = np.random.default_rng(12)
    q, k, v = dense_inputs(rng, 1, 256, 384, 2, 2, 16, np.float32)

    def local(b, h, q_idx, kv_idx):  # sliding window of 100 keys, not block-aligned
        return (kv_idx <= q_idx + 128) & (kv_idx > q_idx + 128 - 100)

    fbm = fa.create_block_mask(local, None, None, 256, 384, device="cpu")
    bm = BlockMask.from_flex(fbm)
    mask = element_mask_from_flex(fbm)
    bias = torch.from_numpy(rand(rng, (1, 2, 256, 384)))
    o = client.forward(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                       block_mask=bm, mask=torch.from_numpy(mask), bias=bias,
                       sinks=torch.tensor([0.0, 1.0]))
    ref_o, _ = reference.attention(q, k, v, block_mask=bm, mask=mask, bias=bias.numpy(),
                                   sinks=[0.0, 1.0])
    check(o.numpy(), ref_o, "fp32")


def test_server_refuses_bad_values(client):
    rng = np.random.default_rng(13)
    q, k, v = dense_inputs(rng, 1, 16, 16, 2, 2, 16, np.float32)
    bias = np.zeros((1, 1, 16, 16), np.float32)
    bias[0, 0, 3, 4] = np.nan
    with pytest.raises(AttnServeError) as e:
        client.forward(q, k, v, bias=bias)
    assert e.value.code.name == "INVALID_ARGUMENT" and "bias" in e.value.message
