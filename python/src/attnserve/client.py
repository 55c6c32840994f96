"""The synchronous attnserve client: Client (unary calls) and ForwardStream (many in flight).

    from attnserve import Client
    with Client("127.0.0.1:50051") as c:
        o = c.forward(q, k, v, causal=True)          # q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]

Arrays go in as NumPy (float16, ml_dtypes.bfloat16, float32) or PyTorch tensors
(CPU or CUDA) and come back as the same kind, on the same device.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Optional

import grpc
from grpc_health.v1 import health_pb2

from attnserve import _channel, _request
from attnserve._request import ForwardResult, Window
from attnserve._stream import BidiStream
from attnserve.errors import AttnServeError
from attnserve.v1 import attention_pb2 as pb


class Client(_channel.ChannelOwner):
    """A connection to one attnserve server (one gRPC channel; thread-safe).

    Args:
      target: "host:port" (any gRPC target: "dns:///svc:50051", "unix:/path").
      timeout: default deadline of each call in seconds (None = no deadline);
        every method also takes its own `timeout`.
      max_attempts: tries per call when the server answers UNAVAILABLE (1 = no
        retry); only for calls that cannot apply twice, see attnserve._channel.
      options: extra gRPC channel options, e.g. [("grpc.keepalive_time_ms", 10000)].
      credentials: grpc.ChannelCredentials for TLS; None = plaintext unless the
        arguments below ask for TLS.
      max_message_bytes: the channel's send/receive limit.
      tls: TLS with the system's roots (implied by root_certificates).
      root_certificates: PEM bytes or file path of the CA that signed the server's
        certificate (the server's --tls_cert).
      certificate_chain, private_key: this client's certificate and key for mutual
        TLS (the server's --tls_client_ca), PEM bytes or file paths.
      token: bearer token sent on every call (the server's --auth_tokens_file);
        None = $ATTNSERVE_TOKEN if set.
    """

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Closes the channels: grpcio's calls in progress are cancelled, native ones
        (attnserve._transport) run to their end."""
        self.channel.close()
        if self._native is not None:
            self._native.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, rpc: Callable, request: Any, timeout: Optional[float]) -> Any:
        try:
            return rpc(request, timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise AttnServeError.from_rpc_error(e) from None

    # -- attention -----------------------------------------------------------
    def forward(self, q: Any, k: Any, v: Any, *, causal: bool = False, window: Window = None,
                softcap: float = 0.0, scale: Optional[float] = None, return_lse: bool = False,
                cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                timeout: Optional[float] = None, q_descale: Optional[float] = None,
                k_descale: Optional[float] = None, v_descale: Optional[float] = None,
                alibi_slopes: Any = None, sinks: Any = None, bias: Any = None, mask: Any = None,
                block_mask: Any = None) -> Any:
        """One attention call (docs/design.md §2), FlashAttention's conventions.

        Args:
          q, k, v: dense q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]; or packed varlen
            q [Tq, Hq, D], k/v [Tk, Hkv, D] with cu_seqlens_q/k. One dtype:
            float16, bfloat16, float32 or float8_e4m3fn (NumPy with ml_dtypes,
            or torch). FP8 inputs give a bfloat16 O.
          causal: bottom-right aligned: query i sees key j iff j <= i + Sk - Sq.
          window: (left, right) sliding window; None or -1 on a side = unlimited.
          softcap: 0 = off, else scores -> softcap * tanh(scores / softcap).
          scale: the softmax scale; None = 1/sqrt(D).
          return_lse: also return the log-sum-exp (FP32, [B, Hq, Sq] or [Hq, Tq]).
          cu_seqlens_q, cu_seqlens_k: B+1 int offsets (list, ndarray or tensor).
          timeout: this call's deadline in seconds (default: the client's).
          q_descale, k_descale, v_descale: FP8 inputs only: each tensor's value
            is its code times this, in (0, 128]; None = 1.
          Score modifiers and masks (docs/masks.md), applied in this order after the
          scale and softcap: + ALiBi, + bias, then causal/window, mask and block_mask
          remove keys; sinks join the softmax denominator:
          alibi_slopes: [Hq] slopes (attnserve.masks.alibi_slopes(Hq) for the paper's);
            score -= slope[h] * |i + Sk - Sq - j|.
          sinks: [Hq] logits (gpt-oss), each adding exp(sink) to its row's denominator.
          bias: additive, float32/float16/bfloat16 (any, whatever q's dtype), dense
            [B or 1, Hq or 1, Sq, Sk] or varlen [Hq or 1, sum of sq_b * sk_b].
          mask: bool (True = attend), the shapes of bias.
          block_mask: an attnserve.masks.BlockMask (block-sparse, CSR).
          A row that sees no key gets O = 0 and LSE = -inf (the sink with sinks).

        Returns:
          O like q (same kind and device; q's dtype, bfloat16 for FP8 q), or
          (O, LSE) with return_lse.

        Raises:
          AttnServeError: with the gRPC code and the server's message.
        """
        result = self.forward_result(q, k, v, causal=causal, window=window, softcap=softcap,
                                     scale=scale, return_lse=return_lse,
                                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     timeout=timeout, q_descale=q_descale, k_descale=k_descale,
                                     v_descale=v_descale, alibi_slopes=alibi_slopes,
                                     sinks=sinks, bias=bias, mask=mask, block_mask=block_mask)
        return (result.o, result.lse) if return_lse else result.o

    def forward_result(self, q: Any, k: Any, v: Any, *, timeout: Optional[float] = None,
                       **options: Any) -> ForwardResult:
        """forward(), returning O, LSE, the server's timing and backend (a ForwardResult)."""
        req = _request.build_request(q, k, v, **options)
        return _request.parse_response(self._call(self._stub.Forward, req, timeout), q)

    def echo(self, q: Any, k: Any, v: Any, *, timeout: Optional[float] = None,
             **options: Any) -> ForwardResult:
        """The transport without compute: validated like forward(), O = the bytes of q."""
        req = _request.build_request(q, k, v, **options)
        return _request.parse_response(self._call(self._stub.Echo, req, timeout), q)

    def stream(self, *, timeout: Optional[float] = None) -> "ForwardStream":
        """A ForwardStream on this channel (close it, or use it as a context manager)."""
        return ForwardStream(self, timeout=timeout)

    # -- server --------------------------------------------------------------
    def info(self, *, timeout: Optional[float] = None) -> pb.GetServerInfoResponse:
        """GetServerInfo: version, backend, devices, dtypes, head dims, limits, features."""
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    def health(self, service: str = "", *, timeout: Optional[float] = None) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING" (draining), ... for service."""
        resp = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service),
                          timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class ForwardStream(BidiStream):
    """Many forward calls in flight on one ForwardStream RPC.

    submit() sends a request and returns a concurrent.futures.Future of its
    ForwardResult at once; responses may come back out of order and are matched
    on request_id. A failed request fails only its own future (AttnServeError);
    the stream goes on. If the stream itself ends with an error, every pending
    future gets it.

        with client.stream() as s:
            futures = [s.submit(q, k, v, causal=True) for q, k, v in batches]
            outs = [f.result().o for f in futures]
    """

    def __init__(self, client: Client, *, timeout: Optional[float] = None):
        super().__init__("ForwardStream", client._stub.ForwardStream, timeout=timeout)

    def submit(self, q: Any, k: Any, v: Any, **options: Any) -> "Future[ForwardResult]":
        """Sends one request (forward()'s arguments); returns the future of its result."""
        req = _request.build_request(q, k, v, **options)
        return self._submit(req, lambda resp: _request.parse_response(resp, q))

    def __enter__(self) -> "ForwardStream":
        return self
