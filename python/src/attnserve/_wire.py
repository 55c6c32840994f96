"""Tensor-carrying messages as protobuf wire bytes, built from and read into array buffers.

Why not the generated classes for these: protobuf's upb runtime copies a
`bytes` field when it is set, again when the message is serialized, and again
when the field is read from a parsed response, each under the GIL; for the
large benchmark request (~200 MB) that is most of a call's time.

Requests: every field that is not a tensor (request_id, options, cu_seqlens,
the K/V API's sequences) goes through the generated class as usual, into a
small message; each Tensor field is then written after it by hand (tag,
length, dtype, packed shape, data) from the array's buffer. The pieces either
go out as they are (attnserve._native: gRPC slices over the arrays, no copy)
or are copied into the one `bytes` grpcio sends (attnserve._concat; large ones
outside the GIL): one copy of each tensor. Protobuf
parsers take fields in any order, so the server parses exactly the message
the generated class would have built (python/tests/test_wire.py holds the two
to each other).

Responses: the top-level fields are walked here; a Tensor field's data is kept
as a memoryview of the received bytes (np.frombuffer of it is a view, no copy),
and the other fields' bytes are parsed by the generated class.

Field numbers and method paths come from the generated descriptors, never
written here a second time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from google.protobuf.message import DecodeError

from attnserve import _concat
from attnserve.v1 import attention_pb2 as pb

# Wire types (protobuf encoding spec).
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

_TENSOR_FIELDS = pb.Tensor.DESCRIPTOR.fields_by_name
_DTYPE_NO = _TENSOR_FIELDS["dtype"].number
_SHAPE_NO = _TENSOR_FIELDS["shape"].number
_DATA_NO = _TENSOR_FIELDS["data"].number
_SHM_NO = _TENSOR_FIELDS["shm"].number


def _varint(n: int) -> bytes:
    """Base-128 varint; a negative int64/int32 as its 64-bit two's complement (10 bytes)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _read_varint(buf: memoryview, pos: int, end: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise DecodeError("attnserve: truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _signed64(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> int:
    """The position after one field's value (the key already read)."""
    if wire_type == _VARINT:
        return _read_varint(buf, pos, end)[1]
    if wire_type == _LEN:
        length, pos = _read_varint(buf, pos, end)
        pos += length
    elif wire_type == _I64:
        pos += 8
    elif wire_type == _I32:
        pos += 4
    else:  # groups (3, 4) never occur in proto3 messages
        raise DecodeError(f"attnserve: unexpected wire type {wire_type}")
    if pos > end:
        raise DecodeError("attnserve: truncated field")
    return pos


# -- requests ------------------------------------------------------------------
@dataclasses.dataclass
class OutTensor:
    """A tensor on its way out: wire dtype, shape, and its bytes (any C-contiguous buffer)."""
    dtype: int
    shape: Tuple[int, ...]
    data: Any


def _tensor_pieces(number: int, t: OutTensor, kind: Any = pb.Tensor.DESCRIPTOR) -> List[Any]:
    """Field `number` holding Tensor t: a short header, then t.data itself (not copied here).
    `kind`: the field's message type, Tensor or one with Tensor's shape and data fields
    (ElementMask: no dtype, t.dtype 0)."""
    fields = kind.fields_by_name
    body = bytearray()
    if t.dtype:  # proto3 leaves default values out, as the generated class does
        body += _key(fields["dtype"].number, _VARINT) + _varint(t.dtype)
    if t.shape:
        dims = b"".join(_varint(int(d)) for d in t.shape)
        body += _key(fields["shape"].number, _LEN) + _varint(len(dims)) + dims
    size = memoryview(t.data).nbytes
    if size:
        body += _key(fields["data"].number, _LEN) + _varint(size)
    head = _key(number, _LEN) + _varint(len(body) + size) + bytes(body)
    return [head, t.data] if size else [head]


@dataclasses.dataclass
class Encoded:
    """A request as the pieces of its bytes, in order: the message without its tensors,
    then each tensor's header and its data (views of the caller's arrays, not copies).
    request_id: what the streams match on."""
    request_id: str
    pieces: List[Any]

    @property
    def data(self) -> bytes:
        """The request as one `bytes`, what grpcio sends: one copy of each tensor
        (attnserve._concat). attnserve._native sends the pieces themselves."""
        return _concat.concat(self.pieces)

    def snapshot(self) -> "Encoded":
        """This request with its bytes copied now. A stream sends a request later, from
        its own thread: a caller that reuses its arrays after submit() must not change
        what goes out."""
        return Encoded(self.request_id, [self.data])


def encode(message: Any, tensors: Iterable[Tuple[str, Optional[OutTensor]]]) -> Encoded:
    """`message` (its tensor fields unset) with each (field name, tensor) after it.

    A name "outer.inner" (e.g. "options.bias") is a tensor inside the message field
    `outer`: written as one more occurrence of `outer` holding only it, which a protobuf
    parser merges into the first (singular message fields merge).
    Copies nothing of the tensors' data: the pieces reference it until sent.
    """
    fields = message.DESCRIPTOR.fields_by_name
    pieces = [message.SerializeToString()]
    for name, t in tensors:
        if t is None:
            continue
        outer, _, inner = name.partition(".")
        holder = getattr(message, outer) if inner else message
        if holder.HasField(inner or name):  # would merge with ours on the server: a bug here
            raise ValueError(f"attnserve._wire: {name} is set on the message as well")
        if not inner:
            pieces += _tensor_pieces(fields[name].number, t)
            continue
        field = fields[outer].message_type.fields_by_name[inner]
        inner_pieces = _tensor_pieces(field.number, t, field.message_type)
        size = sum(memoryview(p).nbytes for p in inner_pieces)
        pieces += [_key(fields[outer].number, _LEN) + _varint(size)] + inner_pieces
    return Encoded(message.request_id, pieces)


def serialize(request: Encoded) -> bytes:
    """grpc's request_serializer for Encoded requests."""
    return request.data


# -- responses -----------------------------------------------------------------
@dataclasses.dataclass
class InTensor:
    """A tensor of a received response; data is a view of the response's bytes. shm: the
    span of a registered region the server wrote it to instead (pb.SharedTensor; the
    call asked for it with output_shm), else None."""
    dtype: int
    shape: Tuple[int, ...]
    data: memoryview
    shm: Optional[Any] = None


@dataclasses.dataclass
class Received:
    """A decoded response: the generated message without its tensor fields, and those."""
    message: Any
    tensors: Dict[str, InTensor]

    @property
    def request_id(self) -> str:
        return self.message.request_id


def _merge_tensor(buf: memoryview, pos: int, end: int, into: Optional[InTensor]) -> InTensor:
    """Parses one Tensor occurrence; a repeated occurrence merges as protobuf does
    (scalars and data: last one wins; shape: appended)."""
    dtype = into.dtype if into else 0
    shape = list(into.shape) if into else []
    data = into.data if into else buf[0:0]
    shm = into.shm if into else None
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if number == _DTYPE_NO and wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            dtype = _signed64(value)
        elif number == _SHAPE_NO and wire_type == _LEN:  # packed
            length, pos = _read_varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise DecodeError("attnserve: truncated Tensor.shape")
            while pos < stop:
                value, pos = _read_varint(buf, pos, stop)
                shape.append(_signed64(value))
        elif number == _SHAPE_NO and wire_type == _VARINT:  # unpacked, also legal
            value, pos = _read_varint(buf, pos, end)
            shape.append(_signed64(value))
        elif number == _DATA_NO and wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if pos + length > end:
                raise DecodeError("attnserve: truncated Tensor.data")
            data = buf[pos:pos + length]
            pos += length
        elif number == _SHM_NO and wire_type == _LEN:  # a small message: the generated class
            length, pos = _read_varint(buf, pos, end)
            if pos + length > end:
                raise DecodeError("attnserve: truncated Tensor.shm")
            part = pb.SharedTensor.FromString(bytes(buf[pos:pos + length]))
            if shm is None:
                shm = part
            else:
                shm.MergeFrom(part)
            pos += length
        else:  # unknown to this client: skipped, as the generated class would
            pos = _skip(buf, pos, end, wire_type)
    return InTensor(dtype, tuple(shape), data, shm)


def decoder(message_class: Any, tensor_names: Sequence[str]) -> Callable[[bytes], Received]:
    """grpc's response_deserializer for message_class whose `tensor_names` are Tensors."""
    fields = message_class.DESCRIPTOR.fields_by_name
    names = {fields[n].number: n for n in tensor_names}
    for n in tensor_names:
        if fields[n].message_type is not pb.Tensor.DESCRIPTOR:
            raise TypeError(f"attnserve._wire: {message_class.__name__}.{n} is not a Tensor")

    def decode(data: bytes) -> Received:
        buf = memoryview(data)
        end = len(buf)
        pos = 0
        rest: List[memoryview] = []
        tensors: Dict[str, InTensor] = {}
        while pos < end:
            start = pos
            key, pos = _read_varint(buf, pos, end)
            name = names.get(key >> 3)
            if name is not None and key & 7 == _LEN:
                length, pos = _read_varint(buf, pos, end)
                if pos + length > end:
                    raise DecodeError(f"attnserve: truncated {name}")
                tensors[name] = _merge_tensor(buf, pos, pos + length, tensors.get(name))
                pos += length
            else:
                pos = _skip(buf, pos, end, key & 7)
                rest.append(buf[start:pos])
        return Received(message_class.FromString(b"".join(rest)), tensors)

    return decode


# -- the methods that carry tensors ----------------------------------------------
def method_path(service: Any, method: str, request_class: Any, response_class: Any) -> str:
    """"/package.Service/Method" from the service descriptor, checked against the classes."""
    m = service.methods_by_name[method]
    if (m.input_type is not request_class.DESCRIPTOR
            or m.output_type is not response_class.DESCRIPTOR):
        raise TypeError(f"attnserve._wire: {service.full_name}.{method} takes "
                        f"{m.input_type.full_name} -> {m.output_type.full_name}")
    return f"/{service.full_name}/{m.name}"
