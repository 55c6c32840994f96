#!/usr/bin/env python3
"""End-to-end tests of sdpa_server.py over real gRPC on 127.0.0.1, on the CPU by default.

    python3 bench/baselines/test_sdpa_server.py -v
    SDPA_TEST_DEVICE=0 python3 bench/baselines/test_sdpa_server.py -v   # on GPU 0

Needs the attnserve package (`pip install ./python`: the generated
attnserve.v1 classes), grpcio-health-checking, torch and numpy (skipped, and
said so, without them). The client side uses the generated AttentionStub; results are
checked against a float64 numpy reference that applies DESIGN.md's masking
rules itself (bottom-right causal, windows, GQA, varlen, empty rows = 0).
`attnctl forward --verify` / `attnctl load --check` are the other half of the
testing (README.md).
"""

import math
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import grpc
    import numpy as np
    import torch  # noqa: F401  (the server needs it; a clear skip reason if missing)
    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as pb_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import sdpa_server
    MISSING = ""
except ImportError as e:  # pragma: no cover
    MISSING = str(e)

NP_DTYPES = {}
if MISSING:  # names the decorators below use
    class pb:  # noqa: N801
        FP16 = BF16 = FP32 = 0
else:
    NP_DTYPES = {pb.FP16: np.float16, pb.FP32: np.float32}


def to_bytes(x, dtype):
    """float array → wire bytes of `dtype` (BF16: round to nearest even from fp32)."""
    if dtype == pb.BF16:
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return u.tobytes()
    return np.ascontiguousarray(x, dtype=NP_DTYPES[dtype]).tobytes()


def from_bytes(b, dtype, shape):
    if dtype == pb.BF16:
        u = np.frombuffer(b, dtype=np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(tuple(shape)).astype(np.float64)
    return np.frombuffer(b, dtype=NP_DTYPES[dtype]).reshape(tuple(shape)).astype(np.float64)


def reference(q, k, v, scale, causal, wl, wr):
    """One sequence, float64: q [Sq, Hq, D], k/v [Sk, Hkv, D] → o [Sq, Hq, D]."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    o = np.zeros((sq, hq, d))
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    allowed = np.ones((sq, sk), dtype=bool)
    if wl is not None:
        allowed &= j >= i - wl
    right = 0 if causal else wr
    if right is not None:
        allowed &= j <= i + right
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        s = np.where(allowed, q[:, h] @ kh.T * scale, -np.inf)
        m = s.max(axis=1, initial=-np.inf, keepdims=True)
        p = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
        den = p.sum(axis=1, keepdims=True)
        o[:, h] = np.where(den > 0, (p @ vh) / np.where(den > 0, den, 1), 0)
    return o


def set_field(msg, name, value):
    """msg.name = value, for the generated classes: None clears, a list replaces a repeated field."""
    if value is None:
        msg.ClearField(name)
    elif isinstance(value, list):
        msg.ClearField(name)
        getattr(msg, name).extend(value)
    else:
        setattr(msg, name, value)


def tensor(x, dtype):
    return pb.Tensor(dtype=dtype, shape=list(x.shape), data=to_bytes(x, dtype))


@unittest.skipIf(MISSING, f"needs grpcio, torch and numpy: {MISSING}")
class ServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        device = sdpa_server.parse_device(os.environ.get("SDPA_TEST_DEVICE", "cpu"))
        cls.service = sdpa_server.SdpaAttention(device, 1 << 28, 4)
        cls.server, port = sdpa_server.make_server(cls.service, 0, "127.0.0.1", 4, 1 << 28)
        cls.server.start()
        cls.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 1 << 28),
            ("grpc.max_send_message_length", 1 << 28)])
        stub = pb_grpc.AttentionStub(cls.channel)
        # Raw bytes in, for the malformed-message case; generated classes otherwise.
        cls.forward_raw = cls.channel.unary_unary(
            "/attnserve.v1.Attention/Forward", request_serializer=lambda b: b,
            response_deserializer=pb.ForwardResponse.FromString)
        cls.stream = stub.ForwardStream
        cls.echo = stub.Echo
        cls.info = stub.GetServerInfo
        cls.health = health_pb2_grpc.HealthStub(cls.channel).Check

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop(None)

    def forward(self, req):
        return self.forward_raw(req.SerializeToString(), timeout=60)

    def make(self, rng, dtype, b, sq, sk, hq, hkv, d, varlen=None, **opts):
        """A random request and its float64 reference output."""
        if varlen:
            lq, lk = varlen
            tq, tk = sum(lq), sum(lk)
            qf, kf, vf = (rng.standard_normal(s) for s in ((tq, hq, d), (tk, hkv, d),
                                                            (tk, hkv, d)))
        else:
            qf, kf, vf = (rng.standard_normal(s) for s in ((b, sq, hq, d), (b, sk, hkv, d),
                                                            (b, sk, hkv, d)))
        req = pb.ForwardRequest(request_id="t", q=tensor(qf, dtype), k=tensor(kf, dtype),
                                v=tensor(vf, dtype), options=pb.AttentionOptions(**opts))
        q, k, v = (from_bytes(t.data, dtype, t.shape) for t in (req.q, req.k, req.v))
        scale = opts.get("softmax_scale") or 1 / math.sqrt(d)
        args = (scale, opts.get("causal", False), opts.get("window_left"),
                opts.get("window_right"))
        if varlen:
            cq = np.concatenate([[0], np.cumsum(lq)]).tolist()
            ck = np.concatenate([[0], np.cumsum(lk)]).tolist()
            req.cu_seqlens_q.extend(cq)
            req.cu_seqlens_k.extend(ck)
            ref = np.zeros(q.shape)
            for i in range(len(lq)):
                ref[cq[i]:cq[i + 1]] = reference(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]],
                                                 v[ck[i]:ck[i + 1]], *args)
        else:
            ref = np.stack([reference(q[i], k[i], v[i], *args) for i in range(b)]) if b else \
                np.zeros(q.shape)
        return req, ref

    def check(self, dtype, *shape, varlen=None, **opts):
        rng = np.random.default_rng(hash((dtype, shape, str(varlen), str(opts))) % 2**32)
        req, ref = self.make(rng, dtype, *shape, varlen=varlen, **opts)
        r = self.forward(req)
        self.assertEqual((r.request_id, r.backend, r.error_code), ("t", "python_sdpa", 0))
        self.assertEqual((r.o.dtype, list(r.o.shape)), (req.q.dtype, list(req.q.shape)))
        self.assertFalse(r.HasField("lse"))
        self.assertGreaterEqual(r.timing.total_us, r.timing.compute_us)
        out = from_bytes(r.o.data, dtype, r.o.shape)
        self.assertTrue(np.isfinite(out).all())
        tol = {pb.FP32: 1e-4, pb.FP16: 5e-3, pb.BF16: 3e-2}[dtype]
        err = np.abs(out - ref).max() if out.size else 0.0
        self.assertLess(err, tol, f"{shape} {varlen} {opts}")

    def test_dense(self):
        self.check(pb.FP32, 2, 17, 17, 4, 4, 64)
        self.check(pb.FP16, 1, 97, 97, 8, 2, 128, causal=True)
        self.check(pb.BF16, 2, 33, 33, 4, 1, 64, causal=True, softmax_scale=0.3)
        self.check(pb.FP32, 1, 1, 300, 8, 2, 128, causal=True)        # decode
        self.check(pb.FP32, 1, 20, 7, 2, 2, 8, causal=True)           # Sq > Sk: empty rows
        self.check(pb.FP32, 2, 200, 70, 4, 4, 64, causal=True)
        self.check(pb.BF16, 2, 200, 70, 4, 4, 128, causal=True)
        self.check(pb.FP32, 2, 70, 200, 4, 4, 64, causal=True)        # Sq < Sk, no GQA
        self.check(pb.BF16, 2, 70, 200, 4, 4, 128, causal=True)
        self.check(pb.FP16, 1, 7, 20, 2, 1, 256, causal=True)         # Sq < Sk
        self.check(pb.FP32, 1, 8, 0, 2, 2, 16)                        # Sk = 0: O = 0
        self.check(pb.FP32, 0, 8, 8, 2, 2, 16)                        # B = 0

    def test_windows(self):
        self.check(pb.FP32, 2, 30, 45, 4, 2, 32, window_left=5, window_right=2)
        self.check(pb.FP32, 1, 45, 30, 4, 4, 32, window_left=3, causal=True)
        self.check(pb.FP32, 1, 40, 20, 2, 2, 32, window_right=0)      # many empty rows
        self.check(pb.FP16, 1, 16, 16, 2, 2, 64, window_left=0, window_right=0)

    def test_varlen(self):
        self.check(pb.FP32, 0, 0, 0, 4, 2, 64, varlen=([3, 0, 17, 5], [5, 4, 40, 0]),
                   causal=True)
        self.check(pb.BF16, 0, 0, 0, 4, 4, 64, varlen=([9, 1], [9, 30]), window_left=2)

    def assert_status(self, req, code, *words, raw=None):
        with self.assertRaises(grpc.RpcError) as cm:
            self.forward_raw(raw if raw is not None else req.SerializeToString(), timeout=60)
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        for w in words:
            self.assertIn(w, cm.exception.details())

    def test_errors(self):
        rng = np.random.default_rng(0)
        base, _ = self.make(rng, pb.FP16, 1, 8, 8, 4, 2, 64)
        inv, unimpl = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED

        def variant(**changes):
            r, _ = self.make(np.random.default_rng(0), pb.FP16, 1, 8, 8, 4, 2, 64)
            for key, value in changes.items():
                obj, attr = (r, key) if "__" not in key else (getattr(r, key.split("__")[0]),
                                                              key.split("__")[1])
                set_field(obj, attr, value)
            return r

        self.assert_status(None, inv, "not a valid", raw=b"\x0a\x09ab")
        self.assert_status(variant(k=None), inv, "k:")
        self.assert_status(variant(q__dtype=0), inv, "q.dtype", "DTYPE_UNSPECIFIED")
        self.assert_status(variant(v__dtype=pb.BF16), inv, "v.dtype", "FP16")
        self.assert_status(variant(q__data=base.q.data[:-2]), inv, "q.data", "expected 4096")
        self.assert_status(variant(q__shape=[1, 8, 4]), inv, "q.shape", "rank 4")
        self.assert_status(variant(v__shape=[1, 8, 1, 128]), inv, "v.shape")
        self.assert_status(variant(k__shape=[1, 8, 3, 64], v__shape=[1, 8, 3, 64]), inv, "k.shape[2]")
        self.assert_status(variant(q__shape=[1, 8, 4, 60], k__shape=[1, 8, 2, 60],
                                   v__shape=[1, 8, 2, 60]), inv, "q.shape[3]", "60")
        self.assert_status(variant(cu_seqlens_q=[0, 8]), inv, "cu_seqlens_k")
        for name, value, word in (("softmax_scale", 0.0, "softmax_scale"),
                                  ("softmax_scale", float("nan"), "softmax_scale"),
                                  ("window_left", -1, "window_left"),
                                  ("softcap", -1.0, "softcap")):
            r = variant()
            setattr(r.options, name, value)
            self.assert_status(r, inv, "options." + word)
        r = variant()
        r.options.softcap = 30.0
        self.assert_status(r, unimpl, "softcap")
        r = variant()
        r.options.return_lse = True
        self.assert_status(r, unimpl, "return_lse")

    def test_varlen_errors(self):
        r, _ = self.make(np.random.default_rng(1), pb.FP32, 0, 0, 0, 2, 2, 16,
                         varlen=([3, 4], [5, 6]))
        for cu_q, cu_k, word in (([1, 3, 7], None, "cu_seqlens_q[0]"),
                                 ([0, 5, 3, 7], [0, 5, 5, 11], "cu_seqlens_q[2]"),
                                 ([0, 3, 6], None, "cu_seqlens_q[2]"),
                                 (None, [0, 11], "cu_seqlens_k")):
            bad = pb.ForwardRequest.FromString(r.SerializeToString())
            set_field(bad, "cu_seqlens_q", cu_q or list(r.cu_seqlens_q))
            set_field(bad, "cu_seqlens_k", cu_k or list(r.cu_seqlens_k))
            self.assert_status(bad, grpc.StatusCode.INVALID_ARGUMENT, word)

    def test_stream_goes_on_after_errors(self):
        rng = np.random.default_rng(2)
        reqs = []
        for i in range(6):
            r, _ = self.make(rng, pb.BF16, 1, 16, 16, 4, 4, 64, causal=True)
            r.request_id = f"id{i}"
            if i % 3 == 1:
                r.q.dtype = pb.FP32  # invalid: mixed dtypes
            reqs.append(r)
        out = list(self.stream(iter(reqs), timeout=60))
        self.assertEqual([o.request_id for o in out], [f"id{i}" for i in range(6)])
        for i, o in enumerate(out):
            if i % 3 == 1:
                self.assertEqual(o.error_code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
                self.assertIn("k.dtype", o.error_message)
                self.assertFalse(o.HasField("o"))
            else:
                self.assertEqual(o.error_code, 0)
                self.assertEqual(list(o.o.shape), [1, 16, 4, 64])

    def test_echo(self):
        req, _ = self.make(np.random.default_rng(3), pb.BF16, 2, 16, 24, 4, 2, 64, causal=True)
        req.options.softcap = 30.0    # UNIMPLEMENTED for Forward, fine for Echo
        req.options.return_lse = True
        r = self.echo(req, timeout=10)
        self.assertEqual((r.o.dtype, list(r.o.shape), r.o.data),
                         (req.q.dtype, list(req.q.shape), req.q.data))
        self.assertEqual((r.lse.dtype, list(r.lse.shape), r.lse.data),
                         (pb.FP32, [2, 4, 16], bytes(4 * 2 * 4 * 16)))
        self.assertEqual((r.backend, r.timing.compute_us), ("python_sdpa", 0))
        req.k.dtype = pb.FP16
        with self.assertRaises(grpc.RpcError) as cm:
            self.echo(req, timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("k.dtype", cm.exception.details())

    def test_info_and_health(self):
        info = self.info(pb.GetServerInfoRequest(), timeout=10)
        self.assertEqual(info.backend, "python_sdpa")
        self.assertEqual(list(info.dtypes), [pb.FP16, pb.BF16, pb.FP32])
        self.assertEqual((info.min_head_dim, info.max_head_dim, info.head_dim_multiple),
                         (8, 256, 8))
        self.assertIn("forward_stream", info.features)
        for service in ("", "attnserve.v1.Attention"):
            self.assertEqual(self.health(health_pb2.HealthCheckRequest(service=service),
                                         timeout=10).status,
                             health_pb2.HealthCheckResponse.SERVING)
        with self.assertRaises(grpc.RpcError) as cm:
            self.health(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)


if __name__ == "__main__":
    unittest.main()
