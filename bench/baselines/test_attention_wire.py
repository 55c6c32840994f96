#!/usr/bin/env python3
"""Tests for attention_wire.py, the hand-written protobuf codec.

    python3 bench/baselines/test_attention_wire.py -v

Needs only the standard library. When `protoc` is on PATH and `google.protobuf`
is importable, it also generates Python classes from the repo's .proto files
and checks, in both directions and on randomised messages, that our encoding
parses to the same message and that protobuf's encoding decodes to the same
values (skipped otherwise, and said so).
"""

import importlib
import importlib.util
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import attention_wire as pb  # noqa: E402


def f32(x):
    """x rounded to float32, as it comes back from the wire."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def random_request(rng):
    def tensor():
        shape = [rng.choice([0, 1, 3, 17, 2**33]) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.1:
            shape.append(-rng.randint(1, 2**40))  # negative int64: 10-byte varints
        return pb.Tensor(dtype=rng.choice([0, 1, 2, 3, 7, -1]), shape=shape,
                         data=bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 5, 300]))))

    o = pb.AttentionOptions(
        softmax_scale=rng.choice([None, 0.0, f32(0.125), f32(-3.5), float("inf")]),
        causal=rng.random() < 0.5,
        window_left=rng.choice([None, 0, 5, -1, 2**31 - 1, -(2**31)]),
        window_right=rng.choice([None, 0, 7, -3]),
        softcap=rng.choice([0.0, f32(30.0), f32(-1.0)]),
        return_lse=rng.random() < 0.5)
    cu = [rng.choice([0, 1, 100, -5, 2**31 - 1]) for _ in range(rng.randint(0, 5))]
    return pb.ForwardRequest(
        request_id=rng.choice(["", "r1", "ünïcødé-" + str(rng.random())]),
        q=tensor() if rng.random() < 0.9 else None,
        k=tensor() if rng.random() < 0.9 else None,
        v=tensor() if rng.random() < 0.9 else None,
        cu_seqlens_q=cu, cu_seqlens_k=list(reversed(cu)), options=o)


def random_response(rng):
    def tensor():
        return pb.Tensor(dtype=rng.choice([1, 2, 3]), shape=[rng.randint(0, 9) for _ in range(3)],
                         data=bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 2, 64]))))
    timing = None
    if rng.random() < 0.8:
        timing = pb.ServerTiming(*[rng.choice([0, 1, 12345, 2**40, -7]) for _ in range(5)],
                                 batch_size=rng.choice([0, 1, 8, -2]))
    return pb.ForwardResponse(
        request_id=rng.choice(["", "x", "id-42"]), o=tensor() if rng.random() < 0.8 else None,
        lse=tensor() if rng.random() < 0.3 else None, timing=timing,
        backend=rng.choice(["", "python_sdpa"]), error_code=rng.choice([0, 3, 12]),
        error_message=rng.choice(["", "k.shape[2]: expected ..."]))


def random_info(rng):
    return pb.GetServerInfoResponse(
        version="v", backend="python_sdpa",
        devices=[pb.DeviceInfo(index=i, name=f"GPU {i}", compute_capability_major=9,
                               compute_capability_minor=0, total_memory_bytes=80 << 30)
                 for i in range(rng.randint(0, 2))],
        dtypes=[1, 2, 3][:rng.randint(0, 3)], min_head_dim=8, max_head_dim=256,
        head_dim_multiple=8,
        limits=rng.choice([None, pb.ServerLimits(1 << 30, 0, 0), pb.ServerLimits(5, 6, 7)]),
        features=["causal", "", "varlen"][:rng.randint(0, 3)], cpu_threads=rng.randint(0, 64))


def tensor_tuple(t):
    return None if t is None else (t.dtype, list(t.shape), bytes(t.data))


def request_tuple(r):
    o = r.options
    return (r.request_id, tensor_tuple(r.q), tensor_tuple(r.k), tensor_tuple(r.v),
            list(r.cu_seqlens_q), list(r.cu_seqlens_k),
            (o.softmax_scale, o.causal, o.window_left, o.window_right, o.softcap, o.return_lse))


def timing_tuple(t):
    return None if t is None else tuple(getattr(t, n) for n in pb.ServerTiming.__slots__)


def response_tuple(r):
    return (r.request_id, tensor_tuple(r.o), tensor_tuple(r.lse), timing_tuple(r.timing),
            r.backend, r.error_code, r.error_message)


def info_tuple(r):
    lim = None if r.limits is None else (r.limits.max_request_bytes, r.limits.max_tokens,
                                         r.limits.max_queue_size)
    return (r.version, r.backend,
            [tuple(getattr(d, n) for n in pb.DeviceInfo.__slots__) for d in r.devices],
            list(r.dtypes), r.min_head_dim, r.max_head_dim, r.head_dim_multiple, lim,
            list(r.features), r.cpu_threads)


def same_floats(a, b):
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


class RoundTrip(unittest.TestCase):
    def test_requests(self):
        rng = random.Random(1)
        for _ in range(300):
            r = random_request(rng)
            back = pb.decode_forward_request(pb.encode_forward_request(r))
            self.assertEqual(request_tuple(back), request_tuple(r))

    def test_responses(self):
        rng = random.Random(2)
        for _ in range(300):
            r = random_response(rng)
            back = pb.decode_forward_response(pb.encode_forward_response(r))
            # An absent timing stays absent; a present one (even all zero) stays present.
            self.assertEqual(response_tuple(back), response_tuple(r))

    def test_server_info_and_health(self):
        rng = random.Random(3)
        for _ in range(50):
            r = random_info(rng)
            back = pb.decode_get_server_info_response(pb.encode_get_server_info_response(r))
            self.assertEqual(info_tuple(back), info_tuple(r))
        for s in ("", "attnserve.v1.Attention"):
            self.assertEqual(pb.decode_health_check_request(
                pb.encode_health_check_request(pb.HealthCheckRequest(s))).service, s)
        for st in range(4):
            self.assertEqual(pb.decode_health_check_response(
                pb.encode_health_check_response(pb.HealthCheckResponse(st))).status, st)
        self.assertIsInstance(pb.decode_get_server_info_request(b""), pb.GetServerInfoRequest)

    def test_bytes_are_not_copied(self):
        payload = os.urandom(1 << 20)
        wire = pb.encode_forward_request(pb.ForwardRequest(q=pb.Tensor(pb.BF16, [1 << 19],
                                                                       payload)))
        r = pb.decode_forward_request(wire)
        self.assertIsInstance(r.q.data, memoryview)
        self.assertIs(r.q.data.obj, wire)  # a slice of the received message
        self.assertEqual(bytes(r.q.data), payload)

    def test_defaults_are_omitted_and_presence_kept(self):
        bare = pb.ForwardRequest()
        bare.options = None
        self.assertEqual(pb.encode_forward_request(bare), b"")
        # Empty options are still present (an empty sub-message: tag 7, length 0).
        self.assertEqual(pb.encode_forward_request(pb.ForwardRequest()), b"\x3a\x00")
        o = pb.decode_forward_request(pb.encode_forward_request(pb.ForwardRequest(
            options=pb.AttentionOptions(softmax_scale=0.0, window_left=0)))).options
        self.assertEqual((o.softmax_scale, o.window_left, o.window_right), (0.0, 0, None))


class HandWritten(unittest.TestCase):
    """Encodings a different writer may legally produce."""

    def test_unpacked_repeated_and_unknown_fields(self):
        tensor = (b"\x08\x02"              # dtype = BF16
                  b"\x10\x02\x10\x03"      # shape 2, 3 unpacked
                  b"\x12\x02\x04\x05"      # shape 4, 5 packed
                  b"\x1a\x03abc"           # data
                  b"\x78\x01"              # unknown field 15, varint
                  b"\x81\x01" + b"\0" * 8 +  # unknown field 16, fixed64
                  b"\x8d\x01" + b"\0" * 4 +  # unknown field 17, fixed32
                  b"\x92\x01\x02hi")       # unknown field 18, bytes
        wire = (b"\x12" + bytes([len(tensor)]) + tensor +
                b"\x28\x00\x28\x05\x28\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"  # cu_q unpacked
                b"\x0a\x02id"  # request_id after other fields
                b"\x3a\x02\x10\x01"  # options: causal
                b"\x3a\x05\x0d\x00\x00\x00\x3f")  # options again (merged): softmax_scale 0.5
        r = pb.decode_forward_request(wire)
        self.assertEqual(r.request_id, "id")
        self.assertEqual((r.q.dtype, r.q.shape, bytes(r.q.data)), (2, [2, 3, 4, 5], b"abc"))
        self.assertIsNone(r.k)
        self.assertEqual(r.cu_seqlens_q, [0, 5, -1])
        self.assertEqual((r.options.causal, r.options.softmax_scale), (True, 0.5))

    def test_int32_truncation(self):
        # An int32 written as a 64-bit varint > 2^32 keeps its low 32 bits (protobuf semantics).
        wire = b"\x28" + bytes([0x81, 0x80, 0x80, 0x80, 0x10])  # 2^32 + 1
        self.assertEqual(pb.decode_forward_request(wire).cu_seqlens_q, [1])

    def test_malformed(self):
        for wire in (b"\x0a\x05ab",         # length past the end
                     b"\x28",               # varint missing
                     b"\x28\xff\xff",       # truncated varint
                     b"\x0b",               # group (wire type 3)
                     b"\x00\x00",           # field 0
                     b"\x3a\x02\x0d\x00",   # truncated fixed32 inside options
                     b"\x12\x01\x0a",       # q.dtype with wire type 2 but no length
                     b"\x0a\x01\xff",       # request_id not UTF-8
                     b"\x28" + b"\xff" * 11):  # varint too long
            with self.assertRaises(pb.WireError, msg=wire.hex()):
                pb.decode_forward_request(wire)


def protoc_classes():
    """Generated modules (attention_pb2, health_pb2), or a reason why not."""
    if shutil.which("protoc") is None:
        return None, "protoc not on PATH"
    try:
        importlib.import_module("google.protobuf")
    except ImportError:
        return None, "google.protobuf not importable"
    out = tempfile.mkdtemp(prefix="attnwire-")
    protos = ["attnserve/v1/attention.proto", "grpc/health/v1/health.proto"]
    subprocess.run(["protoc", f"-I{os.path.join(REPO, 'proto')}", f"--python_out={out}", *protos],
                   check=True)
    sys.path.insert(0, out)
    try:
        # health_pb2 by file path: its package name `grpc` is grpcio's when that is installed.
        return (importlib.import_module("attnserve.v1.attention_pb2"),
                _load(out, "grpc/health/v1/health_pb2.py")), ""
    except Exception as e:  # e.g. a runtime/gencode version mismatch
        return None, f"generated code does not import: {e}"


def _load(root, rel):
    spec = importlib.util.spec_from_file_location("health_pb2", os.path.join(root, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GENERATED, WHY_NOT = protoc_classes()


@unittest.skipIf(GENERATED is None, f"cross-check against protoc skipped: {WHY_NOT}")
class CrossCheckWithProtoc(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.A, cls.H = GENERATED

    def to_proto_request(self, r):
        m = self.A.ForwardRequest(request_id=r.request_id, cu_seqlens_q=r.cu_seqlens_q,
                                  cu_seqlens_k=r.cu_seqlens_k)
        for name in ("q", "k", "v"):
            t = getattr(r, name)
            if t is not None:
                getattr(m, name).SetInParent()
                getattr(m, name).dtype = t.dtype
                getattr(m, name).shape.extend(t.shape)
                getattr(m, name).data = bytes(t.data)
        o = r.options
        m.options.SetInParent()
        if o.softmax_scale is not None:
            m.options.softmax_scale = o.softmax_scale
        m.options.causal = o.causal
        if o.window_left is not None:
            m.options.window_left = o.window_left
        if o.window_right is not None:
            m.options.window_right = o.window_right
        m.options.softcap = o.softcap
        m.options.return_lse = o.return_lse
        return m

    def from_proto_request(self, m):
        def t(name):
            if not m.HasField(name):
                return None
            x = getattr(m, name)
            return (x.dtype, list(x.shape), bytes(x.data))
        o = m.options
        return (m.request_id, t("q"), t("k"), t("v"), list(m.cu_seqlens_q),
                list(m.cu_seqlens_k),
                (o.softmax_scale if o.HasField("softmax_scale") else None, o.causal,
                 o.window_left if o.HasField("window_left") else None,
                 o.window_right if o.HasField("window_right") else None, o.softcap,
                 o.return_lse))

    def test_request_both_ways(self):
        rng = random.Random(4)
        for _ in range(300):
            r = random_request(rng)
            ours = pb.encode_forward_request(r)
            theirs = self.to_proto_request(r)
            # Ours parses with protobuf to the same message...
            parsed = self.A.ForwardRequest.FromString(ours)
            self.assertEqual(parsed, theirs)
            self.assertEqual(self.from_proto_request(parsed), request_tuple(r))
            # ...protobuf's bytes decode with ours to the same values...
            self.assertEqual(request_tuple(pb.decode_forward_request(
                theirs.SerializeToString())), request_tuple(r))
            # ...and (fields in number order, packed repeated) the bytes are identical.
            self.assertEqual(ours, theirs.SerializeToString())

    def test_response_both_ways(self):
        rng = random.Random(5)
        for _ in range(300):
            r = random_response(rng)
            ours = pb.encode_forward_response(r)
            m = self.A.ForwardResponse.FromString(ours)
            self.assertEqual(m.request_id, r.request_id)
            self.assertEqual(m.HasField("o"), r.o is not None)
            self.assertEqual(m.HasField("lse"), r.lse is not None)
            self.assertEqual(m.HasField("timing"), r.timing is not None)
            if r.o is not None:
                self.assertEqual((m.o.dtype, list(m.o.shape), m.o.data), tensor_tuple(r.o))
            if r.timing is not None:
                self.assertEqual(tuple(getattr(m.timing, n) for n in pb.ServerTiming.__slots__),
                                 timing_tuple(r.timing))
            self.assertEqual((m.backend, m.error_code, m.error_message),
                             (r.backend, r.error_code, r.error_message))
            self.assertEqual(ours, m.SerializeToString())
            self.assertEqual(response_tuple(pb.decode_forward_response(m.SerializeToString())),
                             response_tuple(r))

    def test_server_info_both_ways(self):
        rng = random.Random(6)
        for _ in range(50):
            r = random_info(rng)
            ours = pb.encode_get_server_info_response(r)
            m = self.A.GetServerInfoResponse.FromString(ours)
            self.assertEqual(ours, m.SerializeToString())
            self.assertEqual(list(m.features), r.features)
            self.assertEqual(list(m.dtypes), r.dtypes)
            self.assertEqual([d.name for d in m.devices], [d.name for d in r.devices])
            self.assertEqual(m.HasField("limits"), r.limits is not None)
            self.assertEqual(info_tuple(pb.decode_get_server_info_response(m.SerializeToString())),
                             info_tuple(r))

    def test_health_both_ways(self):
        for s in ("", "attnserve.v1.Attention"):
            ours = pb.encode_health_check_request(pb.HealthCheckRequest(s))
            self.assertEqual(self.H.HealthCheckRequest.FromString(ours).service, s)
            self.assertEqual(ours, self.H.HealthCheckRequest(service=s).SerializeToString())
        for st in range(4):
            ours = pb.encode_health_check_response(pb.HealthCheckResponse(st))
            self.assertEqual(self.H.HealthCheckResponse.FromString(ours).status, st)
            self.assertEqual(ours, self.H.HealthCheckResponse(status=st).SerializeToString())


if __name__ == "__main__":
    unittest.main()
