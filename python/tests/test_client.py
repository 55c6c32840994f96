"""The NumPy client against a real CPU server: dtypes, options, varlen, errors, streams, asyncio."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import ml_dtypes
import numpy as np
import pytest

import reference
from attnserve import AsyncClient, AttnServeError, Client

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
# Absolute tolerance on O for values of order 1 (inputs in [-1, 1)); FP32 is
# checked against 1e-5 of the largest |O|, as docs/design.md §4 asks.
ATOL = {"fp32": 1e-5, "fp16": 4e-3, "bf16": 3e-2}


def rand(rng, shape, dtype):
    return rng.uniform(-1, 1, size=shape).astype(np.float32).astype(dtype)


def check(name, out, ref, dtype_name):
    assert out.dtype == np.dtype(DTYPES[dtype_name]), name
    assert out.shape == ref.shape, name
    err = np.max(np.abs(out.astype(np.float64) - ref)) if ref.size else 0.0
    assert err <= ATOL[dtype_name] * max(1.0, np.max(np.abs(ref), initial=0)), f"{name}: {err}"


CASES = [
    # (b, sq, sk, hq, hkv, d, options)
    (2, 17, 17, 4, 4, 64, dict()),
    (1, 97, 97, 8, 2, 128, dict(causal=True)),
    (2, 5, 40, 4, 1, 32, dict(causal=True)),           # decode-like, MQA
    (1, 40, 9, 4, 2, 16, dict(causal=True)),           # Sq > Sk: first rows see nothing
    (2, 33, 50, 4, 2, 64, dict(window=(8, 3))),
    (1, 33, 33, 2, 2, 64, dict(window=(5, -1), causal=True)),
    (2, 16, 24, 4, 4, 8, dict(softcap=2.5)),
    (1, 16, 24, 4, 4, 256, dict(scale=0.05)),
]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}q{c[1]}k{c[2]}h{c[3]}:{c[4]}d{c[5]}"
                         + "".join(f"-{k}" for k in c[6]))
def test_dense(client, dtype_name, case):
    b, sq, sk, hq, hkv, d, opts = case
    rng = np.random.default_rng(hash(case[:6]) % 2**32)
    dt = DTYPES[dtype_name]
    q, k, v = rand(rng, (b, sq, hq, d), dt), rand(rng, (b, sk, hkv, d), dt), rand(rng, (b, sk, hkv, d), dt)
    o, lse = client.forward(q, k, v, return_lse=True, **opts)
    ref_o, ref_lse = reference.attention(q, k, v, **opts)
    check("o", o, ref_o, dtype_name)
    assert lse.dtype == np.float32 and lse.shape == (b, hq, sq)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.allclose(lse[finite], ref_lse[finite], atol=1e-3)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_varlen_with_empty_sequences(client, dtype_name):
    rng = np.random.default_rng(7)
    dt = DTYPES[dtype_name]
    cu_q, cu_k = [0, 3, 3, 20, 29], [0, 5, 9, 49, 49]  # a zero-length q, and a k-less one
    q = rand(rng, (29, 8, 64), dt)
    k, v = rand(rng, (49, 2, 64), dt), rand(rng, (49, 2, 64), dt)
    o, lse = client.forward(q, k, v, causal=True, return_lse=True,
                            cu_seqlens_q=np.array(cu_q, np.int32), cu_seqlens_k=cu_k)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    check("o", o, ref_o, dtype_name)
    assert lse.shape == (8, 29)
    assert np.all(np.isneginf(lse[:, 20:])) and np.all(o[20:].astype(np.float32) == 0)


def test_forward_result_reports_timing_and_backend(client):
    rng = np.random.default_rng(1)
    q = rand(rng, (1, 8, 2, 16), np.float32)
    r = client.forward_result(q, q, q)
    assert r.backend == "cpu" and r.timing.total_us >= r.timing.compute_us >= 0
    assert r.timing.batch_size >= 1 and r.lse is None and r.request_id


def test_non_contiguous_input(client):
    rng = np.random.default_rng(2)
    base = rand(rng, (1, 16, 4, 32), np.float32)
    q = base[:, ::2]  # a strided view: the client gathers it (one copy) before sending
    o = client.forward(q, base, base)
    check("o", o, reference.attention(q, base, base)[0], "fp32")


@pytest.mark.parametrize("kwargs, field", [
    (dict(k_shape=(1, 8, 3, 16)), "k.shape[2]"),              # Hq % Hkv != 0
    (dict(d=12), "q.shape[3]"),                                # head dim not a multiple of 8
    (dict(window=(-2, None)), "options.window_left"),
    (dict(softcap=-1.0), "options.softcap"),
    (dict(scale=0.0), "options.softmax_scale"),
    (dict(cu_seqlens_q=[0, 4, 8], cu_seqlens_k=[0, 4, 9], varlen=True), "cu_seqlens_k"),
])
def test_invalid_argument_names_the_field(client, kwargs, field):
    rng = np.random.default_rng(3)
    d = kwargs.pop("d", 16)
    varlen = kwargs.pop("varlen", False)
    shape = (8, 4, d) if varlen else (1, 8, 4, d)
    k_shape = kwargs.pop("k_shape", shape)
    q, k = rand(rng, shape, np.float32), rand(rng, k_shape, np.float32)
    with pytest.raises(AttnServeError) as e:
        client.forward(q, k, k, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.message, e.value.message


def test_mixed_dtypes_and_unencodable_dtype(client):
    q = np.zeros((1, 4, 2, 16), np.float32)
    with pytest.raises(AttnServeError) as e:
        client.forward(q, q.astype(np.float16), q)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "k.dtype" in e.value.message
    with pytest.raises(AttnServeError) as e:
        client.forward(q.astype(np.float64), q, q)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "q.dtype" in e.value.message


def test_deadline_exceeded(client):
    rng = np.random.default_rng(4)
    q = rand(rng, (4, 2048, 8, 128), np.float32)  # seconds of CPU work against a 1 ms deadline
    with pytest.raises(AttnServeError) as e:
        client.forward(q, q, q, timeout=0.001)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unavailable_after_retries():
    # Nothing listens on port 1: every try is UNAVAILABLE, and the error says so.
    with Client("127.0.0.1:1", timeout=20, max_attempts=3) as c:
        with pytest.raises(AttnServeError) as e:
            c.info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.message


def test_info_and_health(client):
    info = client.info()
    assert info.backend == "cpu" and info.min_head_dim == 8 and info.max_head_dim == 256
    assert "forward_stream" in info.features and info.limits.max_tokens > 0
    assert client.health() == "SERVING"
    assert client.health("attnserve.v1.Attention") == "SERVING"
    with pytest.raises(AttnServeError) as e:
        client.health("no.such.Service")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_echo_returns_q(client):
    rng = np.random.default_rng(5)
    q = rand(rng, (1, 8, 4, 32), ml_dtypes.bfloat16)
    r = client.echo(q, q, q)
    assert r.o.dtype == q.dtype and np.array_equal(r.o.view(np.uint16), q.view(np.uint16))


def test_stream_many_in_flight_with_a_failure(client):
    rng = np.random.default_rng(6)
    inputs = [rand(rng, (1, 8 + i, 4, 32), np.float16) for i in range(12)]
    with client.stream() as s:
        futures = [s.submit(x, x, x, causal=True) for x in inputs]
        bad = s.submit(inputs[0], inputs[0], inputs[0], scale=-1.0)
        after = s.submit(inputs[1], inputs[1], inputs[1])
        for x, f in zip(inputs, futures):
            check("o", f.result(timeout=60).o, reference.attention(x, x, x, causal=True)[0], "fp16")
        with pytest.raises(AttnServeError) as e:
            bad.result(timeout=60)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "options.softmax_scale" in e.value.message and e.value.request_id
        assert after.result(timeout=60).o.shape == inputs[1].shape  # the stream went on


def test_async_stream_takes_submits_from_many_coroutines_at_once(server):
    rng = np.random.default_rng(12)
    # 1.5 MiB a request: large enough that one write is still in progress when the next
    # coroutine writes.
    xs = [rand(rng, (1, 512 + i, 8, 64), np.float16) for i in range(16)]

    async def run():
        async with AsyncClient(server.target) as c, c.stream() as s:
            async def one(x):  # each coroutine submits while others are writing
                return await (await s.submit(x, x, x, causal=True))
            return await asyncio.gather(*(one(x) for x in xs))

    for x, r in zip(xs, asyncio.run(run())):
        check("o", r.o, reference.attention(x, x, x, causal=True)[0], "fp16")


def test_async_client_forward_gather_and_stream(server):
    rng = np.random.default_rng(8)
    xs = [rand(rng, (2, 10 + i, 4, 64), ml_dtypes.bfloat16) for i in range(6)]

    async def run():
        async with AsyncClient(server.target) as c:
            assert await c.health() == "SERVING"
            assert (await c.info()).backend == "cpu"
            outs = await asyncio.gather(*(c.forward(x, x, x, causal=True) for x in xs))
            async with c.stream() as s:
                futures = [await s.submit(x, x, x) for x in xs]
                bad = await s.submit(xs[0], xs[0], xs[0], softcap=-3.0)
                streamed = await asyncio.gather(*futures)
                with pytest.raises(AttnServeError) as e:
                    await bad
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(AttnServeError) as e:
                await c.forward(xs[0], xs[0][..., :2, :], xs[0][..., :2, :].copy()[:, :1])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            return outs, streamed

    outs, streamed = asyncio.run(run())
    for x, o, r in zip(xs, outs, streamed):
        check("o", o, reference.attention(x, x, x, causal=True)[0], "bf16")
        check("o", r.o, reference.attention(x, x, x)[0], "bf16")


def test_command_line(server):
    out = subprocess.run([sys.executable, "-m", "attnserve", f"--target={server.target}", "health"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "SERVING", out.stderr
    out = subprocess.run([sys.executable, "-m", "attnserve", f"--target={server.target}", "info"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '"backend": "cpu"' in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "attnserve", "--target=127.0.0.1:1",
                          "--timeout=5", "info"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_torch_tensors_in_and_out(client):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(9)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        q = torch.rand((2, 12, 4, 32), generator=g).to(dtype) * 2 - 1
        # A strided view [B, Sk, Hkv, D] of a larger tensor: gathered, then sent.
        k = (torch.rand((2, 16, 8, 32), generator=g).to(dtype) * 2 - 1)[:, :, :2]
        assert not k.is_contiguous()
        o, lse = client.forward(q, k, k, causal=True, return_lse=True)
        assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.device == q.device
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (2, 4, 12)
        as_np = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16,
                 torch.float32: np.float32}[dtype]
        qn = q.float().numpy().astype(as_np)
        kn = k.float().numpy().astype(as_np)
        check("o", o.float().numpy().astype(as_np),
              reference.attention(qn, kn, kn, causal=True)[0], name)


def test_fp8_inputs_with_descales(client):
    """FP8 E4M3 codes (ml_dtypes.float8_e4m3fn) with per-tensor descales: O is bfloat16,
    checked like BF16 against the float64 reference on the dequantised inputs."""
    rng = np.random.default_rng(13)
    fp8 = ml_dtypes.float8_e4m3fn
    q = rng.normal(size=(2, 17, 4, 64)).astype(np.float32).astype(fp8)
    k = rng.normal(size=(2, 30, 2, 64)).astype(np.float32).astype(fp8)
    v = rng.normal(size=(2, 30, 2, 64)).astype(np.float32).astype(fp8)
    descales = dict(q_descale=0.5, k_descale=1.25, v_descale=0.2)
    o, lse = client.forward(q, k, v, causal=True, return_lse=True, **descales)
    assert o.dtype == np.dtype(ml_dtypes.bfloat16) and o.shape == q.shape
    deq = [x.astype(np.float64) * descales[n] for x, n in
           ((q, "q_descale"), (k, "k_descale"), (v, "v_descale"))]
    ref_o, ref_lse = reference.attention(*deq, causal=True)
    check("o", o, ref_o, "bf16")
    finite = np.isfinite(ref_lse)
    assert np.allclose(lse[finite], ref_lse[finite], atol=1e-3)
    # Descales are FP8-only, and must be in (0, 128]: the server names the field.
    with pytest.raises(AttnServeError, match="options.k_descale"):
        client.forward(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16),
                       k_descale=2.0)
    with pytest.raises(AttnServeError, match=r"options.v_descale: expected finite and in \(0, 128\]"):
        client.forward(q, k, v, v_descale=0.0)


def test_fp8_torch_tensors(client):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    g = torch.Generator().manual_seed(5)
    q = torch.randn((1, 9, 2, 32), generator=g).to(torch.float8_e4m3fn)
    k = torch.randn((1, 12, 2, 32), generator=g).to(torch.float8_e4m3fn)
    o = client.forward(q, k, k, q_descale=2.0, k_descale=0.5, v_descale=0.5)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
    qn, kn = q.float().numpy() * 2.0, k.float().numpy() * 0.5
    check("o", o.float().numpy().astype(ml_dtypes.bfloat16),
          reference.attention(qn, kn, kn)[0], "bf16")
