"""TLS and bearer tokens for the client channels (the server's --tls_* and --auth_tokens_file).

TLS: `root_certificates` (the CA that signed the server's certificate; None = the
system's roots), and for mutual TLS `certificate_chain` and `private_key`; each is
PEM bytes or the path of a PEM file.

Token: sent as "authorization: Bearer <token>" on every call; None falls back to
$ATTNSERVE_TOKEN. Over TLS it travels as gRPC call credentials. gRPC refuses call
credentials on a plain-text channel, so there a client interceptor adds the header
instead (a token without TLS is for a network that encrypts by other means, e.g.
a service mesh: SECURITY.md).
"""

from __future__ import annotations

import collections
import os
from typing import Any, List, Optional, Union

import grpc
import grpc.aio

Pem = Union[bytes, str, os.PathLike, None]

TOKEN_ENV = "ATTNSERVE_TOKEN"


def _read_pem(name: str, value: Pem) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{name}: cannot read {value!r}: {e.strerror}") from None


def resolve_token(token: Optional[str]) -> Optional[str]:
    """The token to send: `token`, else $ATTNSERVE_TOKEN, else None."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return token


def channel_credentials(credentials: Optional[grpc.ChannelCredentials], tls: bool,
                        root_certificates: Pem, certificate_chain: Pem, private_key: Pem,
                        token: Optional[str]) -> Optional[grpc.ChannelCredentials]:
    """Credentials for a secure channel, or None for a plain-text one."""
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("certificate_chain, private_key: expected both (mutual TLS) or neither")
    if credentials is None and (tls or root_certificates is not None
                                or certificate_chain is not None):
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_pem("root_certificates", root_certificates),
            private_key=_read_pem("private_key", private_key),
            certificate_chain=_read_pem("certificate_chain", certificate_chain))
    if credentials is not None and token:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(token))
    return credentials


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):
    pass


def _with_header(details: Any, header: tuple) -> _Details:
    metadata = list(details.metadata or ()) + [header]
    return _Details(details.method, details.timeout, metadata, details.credentials,
                    getattr(details, "wait_for_ready", None),
                    getattr(details, "compression", None))


class BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the authorization header to every call of a plain-text channel."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_header(details, self._header), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_header(details, self._header), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_header(details, self._header), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_header(details, self._header), request_iterator)


def _aio_details(details: Any, header: tuple) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(tuple(details.metadata or ())))
    metadata.add(*header)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, header: tuple):
        self._header = header

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details, self._header), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, header: tuple):
        self._header = header

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details, self._header), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, header: tuple):
        self._header = header

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self._header), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, header: tuple):
        self._header = header

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self._header), request_iterator)


def aio_interceptors(token: str) -> List[grpc.aio.ClientInterceptor]:
    """The asyncio counterpart of BearerInterceptor (one per call shape)."""
    header = ("authorization", f"Bearer {token}")
    return [_AioUnaryUnary(header), _AioUnaryStream(header), _AioStreamUnary(header),
            _AioStreamStream(header)]
