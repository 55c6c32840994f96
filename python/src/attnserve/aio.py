"""The asyncio attnserve client (grpc.aio): AsyncClient and AsyncForwardStream.

Same methods and arguments as attnserve.Client, as coroutines:

    async with AsyncClient("127.0.0.1:50051") as c:
        o = await c.forward(q, k, v, causal=True)
        outs = await asyncio.gather(*(c.forward(q, k, v) for q, k, v in batches))
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from attnserve import _channel, _request
from attnserve._aio_stream import AsyncBidiStream
from attnserve._request import ForwardResult, Window
from attnserve.errors import AttnServeError
from attnserve.v1 import attention_pb2 as pb


class AsyncClient(_channel.ChannelOwner):
    """attnserve.Client for asyncio: one grpc.aio channel; see Client for the arguments."""

    _grpc = grpc.aio

    async def close(self) -> None:
        """Closes the channels; calls in progress on either are cancelled."""
        await self.channel.close()
        if self._native is not None:
            self._native.close()
        if self._blocking_channel is not None:
            self._blocking_channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, rpc: Any, request: Any, timeout: Optional[float]) -> Any:
        try:
            return await rpc(request, timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None

    async def forward(self, q: Any, k: Any, v: Any, *, causal: bool = False,
                      window: Window = None, softcap: float = 0.0, scale: Optional[float] = None,
                      return_lse: bool = False, cu_seqlens_q: Any = None,
                      cu_seqlens_k: Any = None, timeout: Optional[float] = None,
                      q_descale: Optional[float] = None, k_descale: Optional[float] = None,
                      v_descale: Optional[float] = None, alibi_slopes: Any = None,
                      sinks: Any = None, bias: Any = None, mask: Any = None,
                      block_mask: Any = None) -> Any:
        """Client.forward as a coroutine: O, or (O, LSE) with return_lse."""
        result = await self.forward_result(q, k, v, causal=causal, window=window,
                                           softcap=softcap, scale=scale, return_lse=return_lse,
                                           cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                           timeout=timeout, q_descale=q_descale,
                                           k_descale=k_descale, v_descale=v_descale,
                                           alibi_slopes=alibi_slopes, sinks=sinks, bias=bias,
                                           mask=mask, block_mask=block_mask)
        return (result.o, result.lse) if return_lse else result.o

    async def forward_result(self, q: Any, k: Any, v: Any, *, timeout: Optional[float] = None,
                             **options: Any) -> ForwardResult:
        """Client.forward_result as a coroutine."""
        req = _request.build_request(q, k, v, **options)
        return _request.parse_response(await self._call(self._stub.Forward, req, timeout), q)

    async def echo(self, q: Any, k: Any, v: Any, *, timeout: Optional[float] = None,
                   **options: Any) -> ForwardResult:
        """Client.echo as a coroutine."""
        req = _request.build_request(q, k, v, **options)
        return _request.parse_response(await self._call(self._stub.Echo, req, timeout), q)

    def stream(self, *, timeout: Optional[float] = None) -> "AsyncForwardStream":
        """An AsyncForwardStream (use `async with`, or await close())."""
        return AsyncForwardStream(self, timeout=timeout)

    async def info(self, *, timeout: Optional[float] = None) -> pb.GetServerInfoResponse:
        return await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    async def health(self, service: str = "", *, timeout: Optional[float] = None) -> str:
        resp = await self._call(self._health.Check,
                                health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class AsyncForwardStream(AsyncBidiStream):
    """ForwardStream for asyncio: `await submit(...)` sends and returns an
    asyncio.Future of the ForwardResult; responses are matched on request_id.
    A failed request fails only its own future; the stream goes on.

        async with client.stream() as s:
            futures = [await s.submit(q, k, v) for q, k, v in batches]
            results = await asyncio.gather(*futures)
    """

    def __init__(self, client: AsyncClient, *, timeout: Optional[float] = None):
        super().__init__("ForwardStream", client._stub.ForwardStream, timeout=timeout)

    async def submit(self, q: Any, k: Any, v: Any, **options: Any) -> "asyncio.Future":
        """Sends one request (forward()'s arguments); returns the future of its result."""
        req = _request.build_request(q, k, v, **options)
        return await self._submit(req, lambda resp: _request.parse_response(resp, q))

    async def __aenter__(self) -> "AsyncForwardStream":
        return self
