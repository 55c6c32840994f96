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
