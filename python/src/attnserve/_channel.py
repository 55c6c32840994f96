"""Channel options shared by Client and AsyncClient: message limits and retries.

Retries: gRPC's own retry policy (a service config), only for UNAVAILABLE (no
server reachable, or one draining for shutdown). Every attnserve.v1.Attention
call is stateless, so a retried Forward cannot be applied twice; gRPC retries a
stream only before any response came back. Of the K/V API (attnserve.v1.KvCache)
only the calls that cannot apply twice are retried: AppendAttend carries the
sequence length it expects, so a duplicate is refused (FAILED_PRECONDITION
naming the actual length) instead of applied; Truncate sets a length; stats
only read. CreateCache, CreateSequences, FreeSequences and DropCache are not
retried (a lost success would come back as ALREADY_EXISTS or NOT_FOUND).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import grpc
from grpc_health.v1 import health_pb2_grpc

from attnserve import _security, _stubs, _transport

ChannelOptions = Sequence[Tuple[str, object]]

# A request of the large benchmark scenario is ~200 MB; the server's own limit
# (--max_request_bytes, 1 GiB by default) is the one that should refuse.
DEFAULT_MAX_MESSAGE_BYTES = (1 << 31) - 1
DEFAULT_TIMEOUT_S = 60.0


# The services and methods whose calls are retried (a name without "method"
# covers every method of the service).
RETRIED_CALLS = [
    {"service": "attnserve.v1.Attention"},
    {"service": "grpc.health.v1.Health"},
    {"service": "attnserve.v1.KvCache", "method": "AppendAttend"},
    {"service": "attnserve.v1.KvCache", "method": "Truncate"},
    {"service": "attnserve.v1.KvCache", "method": "GetCacheStats"},
]


def service_config(names: Iterable[dict], max_attempts: int) -> str:
    """A gRPC service config retrying UNAVAILABLE up to max_attempts tries in all."""
    if max_attempts < 2:
        return json.dumps({"methodConfig": []})
    return json.dumps({"methodConfig": [{
        "name": list(names),
        "retryPolicy": {
            "maxAttempts": min(max_attempts, 5),  # gRPC caps it at 5
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]})


def channel_options(options: Optional[ChannelOptions], max_attempts: int,
                    max_message_bytes: int) -> List[Tuple[str, object]]:
    """Our defaults, then the caller's options (which win on the same key)."""
    ours = {
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.enable_retries": 1 if max_attempts >= 2 else 0,
        # gRPC keeps a request this large for a retry (default 256 KiB); a
        # larger one is sent once, and its UNAVAILABLE reaches the caller.
        "grpc.per_rpc_retry_buffer_size": 64 << 20,
        "grpc.service_config": service_config(RETRIED_CALLS, max_attempts),
    }
    for key, value in options or ():
        ours[key] = value
    return list(ours.items())


class ChannelOwner:
    """What Client and AsyncClient share: the channel, its stubs, the default deadline.

    Subclasses set `_grpc` to the module whose channels they use (grpc or grpc.aio).
    """

    _grpc: Any = grpc

    def __init__(self, target: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT_S,
                 max_attempts: int = 3, options: Optional[ChannelOptions] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: bool = False, root_certificates: _security.Pem = None,
                 certificate_chain: _security.Pem = None, private_key: _security.Pem = None,
                 token: Optional[str] = None):
        opts = channel_options(options, max_attempts, max_message_bytes)
        self.target = target
        self.timeout = timeout
        token = _security.resolve_token(token)
        credentials = _security.channel_credentials(
            credentials, tls, root_certificates, certificate_chain, private_key, token)
        # The tensor-carrying calls on gRPC C++ where attnserve._transport says so (its
        # own connection); None: all on grpcio.
        self._native = _transport.native_channel(target, opts,
                                                 plain_text=credentials is None and not token)
        self._channel_args = (target, opts, credentials, token)
        self._blocking_channel = None
        if credentials is not None:
            self.channel = self._grpc.secure_channel(target, credentials, opts)
        elif token and self._grpc is grpc:
            self.channel = grpc.intercept_channel(self._grpc.insecure_channel(target, opts),
                                                  _security.BearerInterceptor(token))
        elif token:
            self.channel = self._grpc.insecure_channel(
                target, opts, interceptors=_security.aio_interceptors(token))
        else:
            self.channel = self._grpc.insecure_channel(target, opts)
        # The tensor-carrying methods on attnserve._wire's codec (_stubs says which).
        self._stub = _stubs.AttentionStub(self.channel, self._native)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._kv = _stubs.KvCacheStub(self.channel, self._native)  # attnserve.kv uses it

    def _sync_channel(self) -> Any:
        """A blocking grpcio channel to the server with this client's credentials: the
        channel itself for Client; for AsyncClient, a twin made on first use (the few
        blocking calls attnserve.shm makes when it creates a region)."""
        if self._grpc is grpc:
            return self.channel
        if self._blocking_channel is None:
            target, opts, credentials, token = self._channel_args
            if credentials is not None:
                self._blocking_channel = grpc.secure_channel(target, credentials, opts)
            elif token:
                self._blocking_channel = grpc.intercept_channel(
                    grpc.insecure_channel(target, opts), _security.BearerInterceptor(token))
            else:
                self._blocking_channel = grpc.insecure_channel(target, opts)
        return self._blocking_channel

    @property
    def transport(self) -> str:
        """What carries forward(), echo(), AppendAttend and both streams: "native" (gRPC
        C++) or "grpcio" (attnserve._transport decides)."""
        return "grpcio" if self._native is None else "native"

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout
