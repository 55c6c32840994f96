"""attnserve._wire against the generated classes: the hand-built request bytes parse to
the message the generated class builds, and a response decodes to what it parses.

No server: the generated class stands for the server's parser (both are protobuf
parsers of the same .proto); test_client.py and test_kv.py send the same bytes to
the real server.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from google.protobuf.message import DecodeError

from attnserve import _concat, _request, _tensors, _wire
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import kv_pb2

DTYPES = {"fp32": (np.float32, pb.FP32), "fp16": (np.float16, pb.FP16),
          "bf16": (ml_dtypes.bfloat16, pb.BF16), "fp8": (ml_dtypes.float8_e4m3fn, pb.FP8_E4M3)}

SHAPES = [
    (1, 8, 2, 16),
    (3, 5, 7, 9),        # odd everywhere
    (1, 0, 2, 8),        # no tokens: a tensor with a shape and no data
    (0, 4, 2, 8),
    (2, 300, 1, 129),    # multi-byte varints in the shape and the lengths
    (7,),
    (),                  # a scalar: no shape field, one element of data
]

OPTIONS = [
    {},
    dict(causal=True),
    dict(window=(8, 3)),
    dict(window=(None, 0), causal=True),
    dict(window=(-1, 5)),
    dict(softcap=2.5, scale=0.125),
    dict(return_lse=True),
    dict(scale=1e-30, softcap=0.0, return_lse=True, causal=True),
    dict(q_descale=0.5, k_descale=2.0, v_descale=128.0),
    dict(request_id="r" * 300),
]


def rand(rng, shape, dtype):
    return rng.uniform(-2, 2, size=shape).astype(np.float32).astype(dtype)


def generated_request(q, k, v, cu_q=None, cu_k=None, request_id="", **options):
    """The ForwardRequest as the generated class builds it, field by field (the reference)."""
    req = pb.ForwardRequest(request_id=request_id)
    for x, field in ((q, req.q), (k, req.k), (v, req.v)):
        field.dtype = DTYPES[next(n for n, (t, _) in DTYPES.items() if np.dtype(t) == x.dtype)][1]
        field.shape.extend(x.shape)
        field.data = np.ascontiguousarray(x).tobytes()
    if cu_q is not None:
        req.cu_seqlens_q.extend(cu_q)
        req.cu_seqlens_k.extend(cu_k)
    descales = {n: options.pop(n) for n in ("q_descale", "k_descale", "v_descale") if n in options}
    _request.fill_options(req.options, causal=options.pop("causal", False),
                          window=options.pop("window", None),
                          softcap=options.pop("softcap", 0.0), scale=options.pop("scale", None),
                          return_lse=options.pop("return_lse", False))
    assert not options
    for name, value in descales.items():
        setattr(req.options, name, value)
    return req


def assert_same(encoded: _wire.Encoded, reference) -> None:
    parsed = type(reference).FromString(encoded.data)
    assert parsed == reference
    # Same bytes once both are re-serialized (field order is the only freedom).
    assert (parsed.SerializeToString(deterministic=True)
            == reference.SerializeToString(deterministic=True))
    assert encoded.request_id == reference.request_id


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_request_dtypes_and_shapes(dtype_name, shape):
    rng = np.random.default_rng(1)
    dtype = DTYPES[dtype_name][0]
    q, k, v = (rand(rng, shape, dtype) for _ in range(3))
    enc = _request.build_request(q, k, v, request_id="id-1")
    assert_same(enc, generated_request(q, k, v, request_id="id-1"))


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "defaults")
def test_request_options(options):
    rng = np.random.default_rng(2)
    q = rand(rng, (2, 6, 4, 16), ml_dtypes.bfloat16)
    k = rand(rng, (2, 9, 2, 16), ml_dtypes.bfloat16)
    options = {"request_id": "opt", **options}
    enc = _request.build_request(q, k, k, **options)
    assert_same(enc, generated_request(q, k, k, **options))


def test_request_varlen_and_generated_id():
    rng = np.random.default_rng(3)
    q = rand(rng, (20, 4, 8), np.float16)
    k = rand(rng, (31, 2, 8), np.float16)
    cu_q, cu_k = [0, 3, 3, 20], np.array([0, 5, 30, 31], dtype=np.int32)
    enc = _request.build_request(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert enc.request_id  # a process-unique one when none is given
    assert_same(enc, generated_request(q, k, k, cu_q, cu_k.tolist(), enc.request_id,
                                       causal=True))


def test_request_non_contiguous_and_torch():
    rng = np.random.default_rng(4)
    base = rand(rng, (2, 16, 4, 32), np.float32)
    q = base[:, ::3, 1:]  # strided
    k = np.asfortranarray(base)
    enc = _request.build_request(q, k, base, request_id="nc")
    assert_same(enc, generated_request(q, k, base, request_id="nc"))
    torch = pytest.importorskip("torch")
    tq = torch.from_numpy(base.astype(np.float32)).to(torch.bfloat16)[:, :, :2]
    as_np = tq.float().numpy().astype(ml_dtypes.bfloat16)
    enc = _request.build_request(tq, tq, tq, request_id="t")
    assert_same(enc, generated_request(as_np, as_np, as_np, request_id="t"))


def test_request_references_the_data_until_a_snapshot_copies_it():
    # A built request's pieces are views of the arrays (no copy: attnserve._native
    # sends them as they are); a stream takes its snapshot() at submit().
    q = np.ones((1, 4, 2, 8), np.float32)
    enc = _request.build_request(q, q, q, request_id="snap")
    kept = enc.snapshot()
    q[:] = 5
    assert pb.ForwardRequest.FromString(enc.data).q.data == q.tobytes()
    assert pb.ForwardRequest.FromString(kept.data).q.data == np.ones(64, np.float32).tobytes()


@pytest.mark.parametrize("size", [0, 1, 1000, (8 << 20) - 1, (8 << 20) + 3, 20 << 20])
def test_concat_equals_join(size):
    """attnserve._concat (the GIL-free copy of pieces from 8 MiB on) == b"".join."""
    rng = np.random.default_rng(size)
    big = rng.integers(0, 256, size, dtype=np.uint8)
    pieces = [b"\x12\x07head", big, b"", np.zeros(0, np.uint8), memoryview(b"tail"),
              big[: size // 3], b"x"]
    out = _concat.concat(pieces)
    assert type(out) is bytes and out == b"".join(pieces)


def test_large_request_over_the_gil_free_copy():
    rng = np.random.default_rng(7)
    q = rand(rng, (2, 1024, 32, 64), ml_dtypes.bfloat16)  # 8 MiB; k and v 4 MiB
    enc = _request.build_request(q, q[:, :512], q[:, :512], request_id="big")
    assert_same(enc, generated_request(q, q[:, :512], q[:, :512], request_id="big"))


def test_append_attend_request():
    """The K/V API's request: sequences and cache_id through the generated class, q
    absent (append only) or k/v absent (attend only)."""
    rng = np.random.default_rng(5)
    k = rand(rng, (5, 2, 16), np.float32)
    q = rand(rng, (3, 4, 16), np.float32)
    for tq, tk in ((q, k), (None, k), (q, None)):
        head = kv_pb2.AppendAttendRequest(request_id="kv", cache_id="c1", layer=3)
        head.sequences.add(sequence_id=2 ** 63, expected_length=7, num_new_tokens=5,
                           num_queries=3)
        _request.fill_options(head.options, causal=True, window=None, softcap=0.0,
                              scale=None, return_lse=True)
        ref = kv_pb2.AppendAttendRequest()
        ref.CopyFrom(head)
        tensors = []
        for name, x in (("q", tq), ("k", tk), ("v", tk)):
            tensors.append((name, None if x is None else _tensors.to_out(name, x)))
            if x is not None:
                field = getattr(ref, name)
                field.dtype, field.data = pb.FP32, x.tobytes()
                field.shape.extend(x.shape)
        assert_same(_wire.encode(head, tensors), ref)


def test_encode_refuses_a_tensor_set_on_the_message():
    req = pb.ForwardRequest(request_id="x")
    req.q.dtype = pb.FP32
    with pytest.raises(ValueError, match="q is set"):
        _wire.encode(req, [("q", _tensors.to_out("q", np.zeros(2, np.float32)))])


# -- responses -----------------------------------------------------------------
DECODE = _wire.decoder(pb.ForwardResponse, ("o", "lse"))


def full_response(dtype=pb.BF16, shape=(1, 3, 2, 8), lse=True):
    rng = np.random.default_rng(6)
    resp = pb.ForwardResponse(request_id="resp-1", backend="cpu", error_code=0)
    resp.o.dtype = dtype
    resp.o.shape.extend(shape)
    resp.o.data = rng.bytes(int(np.prod(shape)) * (4 if dtype == pb.FP32 else 2))
    if lse:
        resp.lse.dtype = pb.FP32
        resp.lse.shape.extend((shape[0], shape[2], shape[1]))
        resp.lse.data = rng.bytes(shape[0] * shape[1] * shape[2] * 4)
    resp.timing.queue_us, resp.timing.compute_us, resp.timing.total_us = 3, 40, 50
    resp.timing.batch_size, resp.timing.device = 2, 1
    return resp


def assert_decoded(received: _wire.Received, reference) -> None:
    """received (header message + tensors) == the generated class's parse `reference`."""
    rest = type(reference)()
    rest.CopyFrom(reference)
    for name in ("o", "lse"):
        rest.ClearField(name)
        if reference.HasField(name):
            t, ref_t = received.tensors[name], getattr(reference, name)
            assert (t.dtype, t.shape, bytes(t.data)) == (ref_t.dtype, tuple(ref_t.shape),
                                                          ref_t.data)
        else:
            assert name not in received.tensors
    assert received.message == rest
    assert received.request_id == reference.request_id


@pytest.mark.parametrize("lse", [True, False])
def test_response_decodes_like_the_generated_class(lse):
    data = full_response(lse=lse).SerializeToString()
    assert_decoded(DECODE(data), pb.ForwardResponse.FromString(data))


def test_response_error_and_empty():
    resp = pb.ForwardResponse(request_id="e", error_code=3, error_message="q.shape[3]: bad")
    data = resp.SerializeToString()
    got = DECODE(data)
    assert_decoded(got, resp)
    assert not got.tensors
    assert_decoded(DECODE(b""), pb.ForwardResponse())


def test_response_o_is_a_view_of_the_received_bytes():
    data = full_response(dtype=pb.FP32, shape=(2, 5, 3, 8)).SerializeToString()
    got = DECODE(data)
    o = _tensors.from_wire("o", got.tensors["o"], np.zeros(1, np.float32))
    lo = np.frombuffer(data, np.uint8).__array_interface__["data"][0]
    at = o.__array_interface__["data"][0]
    assert lo <= at and at + o.nbytes <= lo + len(data)  # inside `data`: no copy was made
    assert o.shape == (2, 5, 3, 8) and not o.flags.writeable
    assert o.tobytes() == pb.ForwardResponse.FromString(data).o.data


def test_response_repeated_and_unknown_fields_merge_as_protobuf_does():
    """A message may legally carry a field twice (merge) or fields this client does not
    know (skipped): the decoder follows the generated class on both."""
    a = full_response(shape=(1, 2, 2, 8)).SerializeToString()
    b = pb.ForwardResponse(request_id="second")
    b.o.shape.append(9)  # appended to o's shape; o.dtype and o.data stay a's
    b.lse.data = b"\x00" * 8  # replaces lse.data
    b.timing.compute_us = 7
    unknown = (bytes([(99 << 3 | 0) & 0x7F | 0x80, 99 >> 4, 1])  # field 99, varint 1
               + bytes([(98 << 3 | 2) & 0x7F | 0x80, 98 >> 4, 2]) + b"hi"  # field 98, "hi"
               + bytes([(97 << 3 | 5) & 0x7F | 0x80, 97 >> 4]) + b"\x01\x02\x03\x04"
               + bytes([(96 << 3 | 1) & 0x7F | 0x80, 96 >> 4]) + b"\x00" * 8)
    # An unpacked shape element and an unknown field inside o as well.
    o_extra = bytes([2 << 3 | 0, 5, 7 << 3 | 0, 1])
    o_again = bytes([2 << 3 | 2, len(o_extra)]) + o_extra
    data = a + unknown + b.SerializeToString() + o_again
    assert_decoded(DECODE(data), pb.ForwardResponse.FromString(data))


@pytest.mark.parametrize("cut", [1, 2, 5, 20, -1])
def test_response_truncated_raises_decode_error(cut):
    data = full_response().SerializeToString()
    with pytest.raises(DecodeError):
        pb.ForwardResponse.FromString(data[:cut])  # the generated class refuses it too
    with pytest.raises(DecodeError):
        DECODE(data[:cut])


def test_append_attend_response():
    decode = _wire.decoder(kv_pb2.AppendAttendResponse, ("o", "lse"))
    resp = kv_pb2.AppendAttendResponse(request_id="kv-1", backend="cpu", lengths=[5, 0, 70000])
    resp.o.dtype = pb.FP16
    resp.o.shape.extend((3, 2, 8))
    resp.o.data = bytes(range(96))
    data = resp.SerializeToString()
    assert_decoded(decode(data), kv_pb2.AppendAttendResponse.FromString(data))


def test_a_shared_memory_output_decodes_its_span():
    # The server wrote O to a registered region (output_shm): o carries dtype, shape and the
    # span, no data; a span split over two occurrences merges as protobuf does.
    decode = _wire.decoder(kv_pb2.AppendAttendResponse, ("o", "lse"))
    resp = kv_pb2.AppendAttendResponse(request_id="kv-shm", lengths=[4])
    resp.o.dtype = pb.FP32
    resp.o.shape.extend((4, 2, 8))
    resp.o.shm.region = "r1"
    resp.o.shm.offset = 512
    again = kv_pb2.AppendAttendResponse()
    again.o.shm.byte_size = 256
    data = resp.SerializeToString() + again.SerializeToString()
    got = decode(data)
    assert got.tensors["o"].shm == kv_pb2.AppendAttendResponse.FromString(data).o.shm
    assert (got.tensors["o"].shm.region, got.tensors["o"].shm.offset,
            got.tensors["o"].shm.byte_size) == ("r1", 512, 256)
    assert bytes(got.tensors["o"].data) == b"" and got.tensors["o"].shape == (4, 2, 8)
    assert DECODE(full_response().SerializeToString()).tensors["o"].shm is None


def test_decoder_and_paths_come_from_the_descriptors():
    with pytest.raises(TypeError, match="not a Tensor"):
        _wire.decoder(pb.ForwardResponse, ("timing",))
    svc = pb.DESCRIPTOR.services_by_name["Attention"]
    assert (_wire.method_path(svc, "Echo", pb.ForwardRequest, pb.ForwardResponse)
            == "/attnserve.v1.Attention/Echo")
    with pytest.raises(TypeError):
        _wire.method_path(svc, "Forward", kv_pb2.AppendAttendRequest, pb.ForwardResponse)
