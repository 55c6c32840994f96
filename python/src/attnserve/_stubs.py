"""The generated gRPC stubs, with the methods that carry tensors on attnserve._wire's codec.

Forward, Echo and ForwardStream (attnserve.v1.Attention), AppendAttend and
AppendAttendStream (attnserve.v1.KvCache) take attnserve._wire.Encoded
requests and return attnserve._wire.Received responses; every other method is
the generated one, unchanged. Works on grpc and grpc.aio channels alike. Given a
native channel (attnserve._transport decides), all five go through it instead of
grpcio: the unary ones as blocking or (aio) awaitable calls, the streams as
attnserve._transport.NativeStream, which attnserve._stream and _aio_stream open.
"""

from __future__ import annotations

from typing import Any, Optional

import grpc
import grpc.aio

from attnserve import _transport, _wire
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve.v1 import kv_pb2, kv_pb2_grpc


def _install(stub: Any, channel: Any, native: Optional[Any], service: Any, request_class: Any,
             response_class: Any, unary: tuple, streams: tuple) -> None:
    decode = _wire.decoder(response_class, ("o", "lse"))
    aio = isinstance(channel, grpc.aio.Channel)
    native_unary = _transport.NativeAsyncUnary if aio else _transport.NativeUnary
    for names, make in ((unary, channel.unary_unary), (streams, channel.stream_stream)):
        for name in names:
            path = _wire.method_path(service, name, request_class, response_class)
            if native is not None:
                kind = native_unary if names is unary else _transport.NativeStream
                setattr(stub, name, kind(native, path, decode))
                continue
            # _registered_method: as the generated stubs call it (registered once per channel).
            setattr(stub, name, make(path, request_serializer=_wire.serialize,
                                     response_deserializer=decode, _registered_method=True))


class AttentionStub(pb_grpc.AttentionStub):
    def __init__(self, channel: Any, native: Optional[Any] = None):
        super().__init__(channel)
        _install(self, channel, native, pb.DESCRIPTOR.services_by_name["Attention"],
                 pb.ForwardRequest, pb.ForwardResponse, unary=("Forward", "Echo"),
                 streams=("ForwardStream",))


class KvCacheStub(kv_pb2_grpc.KvCacheStub):
    def __init__(self, channel: Any, native: Optional[Any] = None):
        super().__init__(channel)
        _install(self, channel, native, kv_pb2.DESCRIPTOR.services_by_name["KvCache"],
                 kv_pb2.AppendAttendRequest, kv_pb2.AppendAttendResponse,
                 unary=("AppendAttend",), streams=("AppendAttendStream",))
