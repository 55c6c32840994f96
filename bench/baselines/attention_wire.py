"""A small hand-written protobuf wire-format codec for attnserve.v1 and grpc.health.v1.

Why this exists: the GPU benchmark machine has grpcio, PyTorch and numpy but
no `google.protobuf` runtime and no `grpc_tools` (so no protoc-generated
Python classes), and no network to install them. grpcio itself only moves
bytes: a generic handler with our own request_deserializer /
response_serializer is enough to serve `attnserve.v1.Attention` if we can turn
those bytes into messages and back. This module does exactly that for the
messages the baseline server needs, and nothing more.

It is also faster than it needs to be where it matters: `bytes` fields are
decoded as `memoryview` slices of the received message (no copy), so
`torch.frombuffer` can read Q/K/V straight out of the gRPC receive buffer; and
encoding returns the message as a list of chunks joined once, so the O tensor
is copied exactly once into the bytes grpcio sends.

Wire format summary (https://protobuf.dev/programming-guides/encoding/):
  - A message is a sequence of records `tag value`; tag = varint(field << 3 | wire_type).
  - wire type 0 VARINT: base-128 varint, least significant group first. int32 and
    int64 and enums are two's complement 64-bit (a negative number takes 10
    bytes); bool is 0/1.
  - wire type 1 I64: 8 bytes little-endian (double, fixed64); not used by our messages.
  - wire type 2 LEN: varint length, then that many bytes: strings (UTF-8), bytes,
    sub-messages, and packed repeated scalars (concatenated varints).
  - wire type 5 I32: 4 bytes little-endian (float, fixed32).
  - wire types 3/4 (groups) are deprecated; a proto3 schema cannot produce them.
  - proto3 scalars equal to their default (0, "", false) are not written, unless
    the field is `optional` (explicit presence); a parser must accept repeated
    scalars both packed (one LEN record) and unpacked (one record per element),
    take the last value of a repeated-in-the-wire singular scalar, merge repeated
    occurrences of a singular sub-message, and skip fields it does not know.

Messages are plain Python classes with the proto field names. `decode_*`
functions take bytes-like objects and raise WireError on malformed input;
`encode_*` functions return `bytes`.
"""

import struct

__all__ = [
    "WireError",
    "DTYPE_UNSPECIFIED", "FP16", "BF16", "FP32", "DTYPE_NAMES",
    "Tensor", "AttentionOptions", "ForwardRequest", "ServerTiming", "ForwardResponse",
    "GetServerInfoRequest", "DeviceInfo", "ServerLimits", "GetServerInfoResponse",
    "HealthCheckRequest", "HealthCheckResponse",
    "SERVING_STATUS_UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN",
    "decode_forward_request", "encode_forward_request",
    "decode_forward_response", "encode_forward_response",
    "decode_get_server_info_request", "encode_get_server_info_request",
    "decode_get_server_info_response", "encode_get_server_info_response",
    "decode_health_check_request", "encode_health_check_request",
    "decode_health_check_response", "encode_health_check_response",
]

# attnserve.v1.DType
DTYPE_UNSPECIFIED = 0
FP16 = 1
BF16 = 2
FP32 = 3
DTYPE_NAMES = {DTYPE_UNSPECIFIED: "DTYPE_UNSPECIFIED", FP16: "FP16", BF16: "BF16", FP32: "FP32"}

# grpc.health.v1.HealthCheckResponse.ServingStatus
SERVING_STATUS_UNKNOWN = 0
SERVING = 1
NOT_SERVING = 2
SERVICE_UNKNOWN = 3

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MASK64 = (1 << 64) - 1
_F32 = struct.Struct("<f")


class WireError(ValueError):
    """The bytes are not a valid encoding of the expected message."""


# --------------------------------------------------------------------------
# Decoding primitives
# --------------------------------------------------------------------------

def _read_varint(buf, pos, end):
    """Returns (unsigned value, new pos). At most 10 bytes, as protobuf allows."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _int64(u):
    """Unsigned 64-bit varint value -> signed int64 (two's complement)."""
    return u - (1 << 64) if u >= (1 << 63) else u


def _int32(u):
    """Varint value -> int32: protobuf truncates to the low 32 bits, then signs."""
    u &= 0xFFFFFFFF
    return u - (1 << 32) if u >= (1 << 31) else u


def _fields(data):
    """Yields (field_number, wire_type, value) for each record of a message.

    value is an unsigned int for VARINT, a memoryview slice for LEN (no copy),
    raw little-endian bytes (as a memoryview) for I32/I64.
    """
    buf = data if isinstance(data, memoryview) else memoryview(data)
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B")
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise WireError("field number 0")
        if wt == _VARINT:
            value, pos = _read_varint(buf, pos, end)
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos, end)
            if n > end - pos:
                raise WireError(f"field {field}: length {n} runs past the end of the message")
            value = buf[pos:pos + n]
            pos += n
        elif wt == _I32:
            if pos + 4 > end:
                raise WireError(f"field {field}: truncated fixed32")
            value = buf[pos:pos + 4]
            pos += 4
        elif wt == _I64:
            if pos + 8 > end:
                raise WireError(f"field {field}: truncated fixed64")
            value = buf[pos:pos + 8]
            pos += 8
        else:
            # 3/4 = start/end group: never produced by proto3 schemas.
            raise WireError(f"field {field}: unsupported wire type {wt}")
        yield field, wt, value


def _expect(field, wt, want, name):
    if wt != want:
        raise WireError(f"{name} (field {field}): wire type {wt}, expected {want}")


def _repeated_varints(field, wt, value, name, out, conv):
    """Appends a repeated varint field, packed (LEN) or not (VARINT)."""
    if wt == _VARINT:
        out.append(conv(value))
    elif wt == _LEN:
        pos, end = 0, len(value)
        while pos < end:
            u, pos = _read_varint(value, pos, end)
            out.append(conv(u))
    else:
        raise WireError(f"{name} (field {field}): wire type {wt} for a repeated varint")


def _string(field, wt, value, name):
    _expect(field, wt, _LEN, name)
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(f"{name} (field {field}): not valid UTF-8") from e


def _float(field, wt, value, name):
    _expect(field, wt, _I32, name)
    return _F32.unpack(value)[0]


# --------------------------------------------------------------------------
# Encoding primitives
# --------------------------------------------------------------------------

def _varint(u):
    """Encodes an int as a varint; negatives as 64-bit two's complement (10 bytes)."""
    u &= _MASK64
    out = bytearray()
    while u >= 0x80:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


def _tag(field, wt):
    return _varint(field << 3 | wt)


class _Writer:
    """Accumulates a message as chunks (bytes or buffers) without joining them."""

    __slots__ = ("chunks", "size")

    def __init__(self):
        self.chunks = []
        self.size = 0

    def raw(self, b):
        self.chunks.append(b)
        self.size += len(b) if not isinstance(b, memoryview) else b.nbytes

    def varint(self, field, value, always=False):
        if value or always:
            self.raw(_tag(field, _VARINT) + _varint(int(value)))

    def float32(self, field, value, always=False):
        if value or always:
            self.raw(_tag(field, _I32) + _F32.pack(value))

    def bytes_field(self, field, value, always=False):
        """A bytes field whose payload may be any buffer; it is not copied here."""
        if not isinstance(value, memoryview):
            value = memoryview(value)
        if value.ndim != 1 or value.itemsize != 1:
            value = value.cast("B")
        n = value.nbytes
        if n or always:
            self.raw(_tag(field, _LEN) + _varint(n))
            if n:
                self.raw(value)

    def string(self, field, value):
        if value:
            self.bytes_field(field, value.encode("utf-8"))

    def packed(self, field, values):
        if values:
            payload = b"".join(_varint(int(v)) for v in values)
            self.raw(_tag(field, _LEN) + _varint(len(payload)) + payload)

    def message(self, field, sub):
        """A sub-message (a _Writer); written even when empty, as presence matters."""
        self.raw(_tag(field, _LEN) + _varint(sub.size))
        self.chunks.extend(sub.chunks)
        self.size += sub.size

    def tobytes(self):
        return b"".join(self.chunks)


# --------------------------------------------------------------------------
# attnserve.v1 messages
# --------------------------------------------------------------------------

class Tensor:
    """attnserve.v1.Tensor. `data` is a memoryview slice when decoded."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype=DTYPE_UNSPECIFIED, shape=(), data=b""):
        self.dtype = dtype
        self.shape = list(shape)
        self.data = data

    def __repr__(self):
        return (f"Tensor(dtype={DTYPE_NAMES.get(self.dtype, self.dtype)}, shape={self.shape}, "
                f"{memoryview(self.data).nbytes} bytes)")


def _decode_tensor(data):
    t = Tensor()
    for field, wt, value in _fields(data):
        if field == 1:
            _expect(field, wt, _VARINT, "Tensor.dtype")
            t.dtype = _int32(value)
        elif field == 2:
            _repeated_varints(field, wt, value, "Tensor.shape", t.shape, _int64)
        elif field == 3:
            _expect(field, wt, _LEN, "Tensor.data")
            t.data = value  # memoryview into the request: no copy
    return t


def _write_tensor(t):
    w = _Writer()
    w.varint(1, t.dtype)
    w.packed(2, t.shape)
    w.bytes_field(3, t.data)
    return w


class AttentionOptions:
    """attnserve.v1.AttentionOptions; `optional` fields are None when absent."""

    __slots__ = ("softmax_scale", "causal", "window_left", "window_right", "softcap", "return_lse")

    def __init__(self, softmax_scale=None, causal=False, window_left=None, window_right=None,
                 softcap=0.0, return_lse=False):
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.window_left = window_left
        self.window_right = window_right
        self.softcap = softcap
        self.return_lse = return_lse


def _decode_options(data, o):
    for field, wt, value in _fields(data):
        if field == 1:
            o.softmax_scale = _float(field, wt, value, "AttentionOptions.softmax_scale")
        elif field == 2:
            _expect(field, wt, _VARINT, "AttentionOptions.causal")
            o.causal = value != 0
        elif field == 3:
            _expect(field, wt, _VARINT, "AttentionOptions.window_left")
            o.window_left = _int32(value)
        elif field == 4:
            _expect(field, wt, _VARINT, "AttentionOptions.window_right")
            o.window_right = _int32(value)
        elif field == 5:
            o.softcap = _float(field, wt, value, "AttentionOptions.softcap")
        elif field == 6:
            _expect(field, wt, _VARINT, "AttentionOptions.return_lse")
            o.return_lse = value != 0
    return o


def _write_options(o):
    w = _Writer()
    if o.softmax_scale is not None:
        w.float32(1, o.softmax_scale, always=True)
    w.varint(2, o.causal)
    if o.window_left is not None:
        w.varint(3, o.window_left, always=True)
    if o.window_right is not None:
        w.varint(4, o.window_right, always=True)
    w.float32(5, o.softcap)
    w.varint(6, o.return_lse)
    return w


class ForwardRequest:
    """attnserve.v1.ForwardRequest; q/k/v are None when absent."""

    __slots__ = ("request_id", "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "options",
                 "received_ns")

    def __init__(self, request_id="", q=None, k=None, v=None, cu_seqlens_q=(), cu_seqlens_k=(),
                 options=None):
        self.request_id = request_id
        self.q = q
        self.k = k
        self.v = v
        self.cu_seqlens_q = list(cu_seqlens_q)
        self.cu_seqlens_k = list(cu_seqlens_k)
        self.options = options if options is not None else AttentionOptions()
        self.received_ns = 0  # not on the wire: set by the server when decoded


def _merge_tensor(old, data):
    # A singular sub-message that appears twice is merged (protobuf semantics).
    new = _decode_tensor(data)
    if old is None:
        return new
    if new.dtype:
        old.dtype = new.dtype
    old.shape.extend(new.shape)
    if memoryview(new.data).nbytes:
        old.data = new.data
    return old


def decode_forward_request(data):
    r = ForwardRequest()
    for field, wt, value in _fields(data):
        if field == 1:
            r.request_id = _string(field, wt, value, "ForwardRequest.request_id")
        elif field in (2, 3, 4):
            name = "qkv"[field - 2]
            _expect(field, wt, _LEN, "ForwardRequest." + name)
            setattr(r, name, _merge_tensor(getattr(r, name), value))
        elif field == 5:
            _repeated_varints(field, wt, value, "ForwardRequest.cu_seqlens_q", r.cu_seqlens_q,
                              _int32)
        elif field == 6:
            _repeated_varints(field, wt, value, "ForwardRequest.cu_seqlens_k", r.cu_seqlens_k,
                              _int32)
        elif field == 7:
            _expect(field, wt, _LEN, "ForwardRequest.options")
            _decode_options(value, r.options)
    return r


def encode_forward_request(r):
    w = _Writer()
    w.string(1, r.request_id)
    for field, t in ((2, r.q), (3, r.k), (4, r.v)):
        if t is not None:
            w.message(field, _write_tensor(t))
    w.packed(5, r.cu_seqlens_q)
    w.packed(6, r.cu_seqlens_k)
    if r.options is not None:
        w.message(7, _write_options(r.options))
    return w.tobytes()


class ServerTiming:
    __slots__ = ("queue_us", "host_to_device_us", "compute_us", "device_to_host_us", "total_us",
                 "batch_size")

    def __init__(self, queue_us=0, host_to_device_us=0, compute_us=0, device_to_host_us=0,
                 total_us=0, batch_size=0):
        self.queue_us = queue_us
        self.host_to_device_us = host_to_device_us
        self.compute_us = compute_us
        self.device_to_host_us = device_to_host_us
        self.total_us = total_us
        self.batch_size = batch_size


_TIMING_FIELDS = ServerTiming.__slots__  # field numbers 1..6 in this order


class ForwardResponse:
    """attnserve.v1.ForwardResponse; o/lse/timing are None when absent."""

    __slots__ = ("request_id", "o", "lse", "timing", "backend", "error_code", "error_message")

    def __init__(self, request_id="", o=None, lse=None, timing=None, backend="", error_code=0,
                 error_message=""):
        self.request_id = request_id
        self.o = o
        self.lse = lse
        self.timing = timing
        self.backend = backend
        self.error_code = error_code
        self.error_message = error_message


def encode_forward_response(r):
    w = _Writer()
    w.string(1, r.request_id)
    if r.o is not None:
        w.message(2, _write_tensor(r.o))
    if r.lse is not None:
        w.message(3, _write_tensor(r.lse))
    if r.timing is not None:
        t = _Writer()
        for i, name in enumerate(_TIMING_FIELDS):
            t.varint(i + 1, getattr(r.timing, name))
        w.message(4, t)
    w.string(5, r.backend)
    w.varint(6, r.error_code)
    w.string(7, r.error_message)
    return w.tobytes()


def decode_forward_response(data):
    r = ForwardResponse()
    for field, wt, value in _fields(data):
        if field == 1:
            r.request_id = _string(field, wt, value, "ForwardResponse.request_id")
        elif field in (2, 3):
            _expect(field, wt, _LEN, "ForwardResponse.o/lse")
            name = "o" if field == 2 else "lse"
            setattr(r, name, _merge_tensor(getattr(r, name), value))
        elif field == 4:
            _expect(field, wt, _LEN, "ForwardResponse.timing")
            if r.timing is None:
                r.timing = ServerTiming()
            for f, twt, tv in _fields(value):
                if 1 <= f <= len(_TIMING_FIELDS):
                    _expect(f, twt, _VARINT, "ServerTiming." + _TIMING_FIELDS[f - 1])
                    setattr(r.timing, _TIMING_FIELDS[f - 1], _int32(tv) if f == 6 else _int64(tv))
        elif field == 5:
            r.backend = _string(field, wt, value, "ForwardResponse.backend")
        elif field == 6:
            _expect(field, wt, _VARINT, "ForwardResponse.error_code")
            r.error_code = _int32(value)
        elif field == 7:
            r.error_message = _string(field, wt, value, "ForwardResponse.error_message")
    return r


class GetServerInfoRequest:
    __slots__ = ()


def decode_get_server_info_request(data):
    for _ in _fields(data):  # no fields; validates the framing and skips unknowns
        pass
    return GetServerInfoRequest()


def encode_get_server_info_request(_r=None):
    return b""


class DeviceInfo:
    __slots__ = ("index", "name", "compute_capability_major", "compute_capability_minor",
                 "total_memory_bytes")

    def __init__(self, index=0, name="", compute_capability_major=0, compute_capability_minor=0,
                 total_memory_bytes=0):
        self.index = index
        self.name = name
        self.compute_capability_major = compute_capability_major
        self.compute_capability_minor = compute_capability_minor
        self.total_memory_bytes = total_memory_bytes


class ServerLimits:
    __slots__ = ("max_request_bytes", "max_tokens", "max_queue_size")

    def __init__(self, max_request_bytes=0, max_tokens=0, max_queue_size=0):
        self.max_request_bytes = max_request_bytes
        self.max_tokens = max_tokens
        self.max_queue_size = max_queue_size


class GetServerInfoResponse:
    __slots__ = ("version", "backend", "devices", "dtypes", "min_head_dim", "max_head_dim",
                 "head_dim_multiple", "limits", "features", "cpu_threads")

    def __init__(self, version="", backend="", devices=(), dtypes=(), min_head_dim=0,
                 max_head_dim=0, head_dim_multiple=0, limits=None, features=(), cpu_threads=0):
        self.version = version
        self.backend = backend
        self.devices = list(devices)
        self.dtypes = list(dtypes)
        self.min_head_dim = min_head_dim
        self.max_head_dim = max_head_dim
        self.head_dim_multiple = head_dim_multiple
        self.limits = limits
        self.features = list(features)
        self.cpu_threads = cpu_threads


def encode_get_server_info_response(r):
    w = _Writer()
    w.string(1, r.version)
    w.string(2, r.backend)
    for d in r.devices:
        dw = _Writer()
        dw.varint(1, d.index)
        dw.string(2, d.name)
        dw.varint(3, d.compute_capability_major)
        dw.varint(4, d.compute_capability_minor)
        dw.varint(5, d.total_memory_bytes)
        w.message(3, dw)
    w.packed(4, r.dtypes)
    w.varint(5, r.min_head_dim)
    w.varint(6, r.max_head_dim)
    w.varint(7, r.head_dim_multiple)
    if r.limits is not None:
        lw = _Writer()
        lw.varint(1, r.limits.max_request_bytes)
        lw.varint(2, r.limits.max_tokens)
        lw.varint(3, r.limits.max_queue_size)
        w.message(8, lw)
    for f in r.features:
        w.bytes_field(9, f.encode("utf-8"), always=True)  # repeated: empty strings count
    w.varint(10, r.cpu_threads)
    return w.tobytes()


def decode_get_server_info_response(data):
    r = GetServerInfoResponse()
    for field, wt, value in _fields(data):
        if field == 1:
            r.version = _string(field, wt, value, "version")
        elif field == 2:
            r.backend = _string(field, wt, value, "backend")
        elif field == 3:
            _expect(field, wt, _LEN, "devices")
            d = DeviceInfo()
            for f, dwt, dv in _fields(value):
                if f == 2:
                    d.name = _string(f, dwt, dv, "DeviceInfo.name")
                elif f in (1, 3, 4, 5):
                    _expect(f, dwt, _VARINT, "DeviceInfo")
                    name = {1: "index", 3: "compute_capability_major",
                            4: "compute_capability_minor", 5: "total_memory_bytes"}[f]
                    setattr(d, name, _int64(dv) if f == 5 else _int32(dv))
            r.devices.append(d)
        elif field == 4:
            _repeated_varints(field, wt, value, "dtypes", r.dtypes, _int32)
        elif field in (5, 6, 7, 10):
            _expect(field, wt, _VARINT, "GetServerInfoResponse")
            name = {5: "min_head_dim", 6: "max_head_dim", 7: "head_dim_multiple",
                    10: "cpu_threads"}[field]
            setattr(r, name, _int32(value))
        elif field == 8:
            _expect(field, wt, _LEN, "limits")
            if r.limits is None:
                r.limits = ServerLimits()
            for f, lwt, lv in _fields(value):
                if f in (1, 2, 3):
                    _expect(f, lwt, _VARINT, "ServerLimits")
                    name = ServerLimits.__slots__[f - 1]
                    setattr(r.limits, name, _int32(lv) if f == 3 else _int64(lv))
        elif field == 9:
            r.features.append(_string(field, wt, value, "features"))
    return r


# --------------------------------------------------------------------------
# grpc.health.v1
# --------------------------------------------------------------------------

class HealthCheckRequest:
    __slots__ = ("service",)

    def __init__(self, service=""):
        self.service = service


class HealthCheckResponse:
    __slots__ = ("status",)

    def __init__(self, status=SERVING_STATUS_UNKNOWN):
        self.status = status


def decode_health_check_request(data):
    r = HealthCheckRequest()
    for field, wt, value in _fields(data):
        if field == 1:
            r.service = _string(field, wt, value, "HealthCheckRequest.service")
    return r


def encode_health_check_request(r):
    w = _Writer()
    w.string(1, r.service)
    return w.tobytes()


def decode_health_check_response(data):
    r = HealthCheckResponse()
    for field, wt, value in _fields(data):
        if field == 1:
            _expect(field, wt, _VARINT, "HealthCheckResponse.status")
            r.status = _int32(value)
    return r


def encode_health_check_response(r):
    w = _Writer()
    w.varint(1, r.status)
    return w.tobytes()

