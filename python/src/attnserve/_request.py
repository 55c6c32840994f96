"""One forward call's arguments to a ForwardRequest, and a ForwardResponse to a result.

Shared by the sync and asyncio clients and both streaming forms, so the mapping
from Python arguments to wire fields is written once. The server validates
everything (docs/design.md §2); the client only refuses what it cannot encode.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Optional, Tuple

import grpc

from attnserve import _mods, _tensors, _wire
from attnserve.errors import AttnServeError, invalid_argument
from attnserve.v1 import attention_pb2 as pb

# Window sides: None or -1 = unlimited (FlashAttention's window_size=(-1, -1)).
Window = Optional[Tuple[Optional[int], Optional[int]]]

_ids = itertools.count(1)
_id_prefix = f"py{os.getpid()}-"


def next_request_id() -> str:
    """A process-unique request id (ForwardStream matches responses on it)."""
    return f"{_id_prefix}{next(_ids)}"


@dataclasses.dataclass
class ServerTiming:
    """Server-side microseconds for one request (ForwardResponse.timing)."""
    queue_us: int
    host_to_device_us: int
    compute_us: int
    device_to_host_us: int
    total_us: int
    batch_size: int
    device: int


@dataclasses.dataclass
class ForwardResult:
    """A successful call: O (like Q), LSE (FP32, only with return_lse), and what ran it."""
    o: Any
    lse: Optional[Any]
    timing: ServerTiming
    backend: str
    request_id: str


def fill_options(opts: pb.AttentionOptions, *, causal: bool, window: Window, softcap: float,
                 scale: Optional[float], return_lse: bool) -> None:
    """AttentionOptions from forward()'s keyword arguments (also the K/V API's AppendAttend)."""
    opts.causal = bool(causal)
    opts.softcap = float(softcap)
    opts.return_lse = bool(return_lse)
    if scale is not None:
        opts.softmax_scale = float(scale)
    if window is not None:
        if len(window) != 2:
            raise invalid_argument(f"window: expected (left, right), got {window!r}")
        left, right = window
        # -1 is FlashAttention's "unlimited"; other negatives go to the server,
        # which names the field in its INVALID_ARGUMENT.
        if left is not None and left != -1:
            opts.window_left = int(left)
        if right is not None and right != -1:
            opts.window_right = int(right)


def server_timing(t: pb.ServerTiming) -> ServerTiming:
    """The wire's ServerTiming as the dataclass."""
    return ServerTiming(t.queue_us, t.host_to_device_us, t.compute_us, t.device_to_host_us,
                        t.total_us, t.batch_size, t.device)


def build_request(q: Any, k: Any, v: Any, *, causal: bool = False, window: Window = None,
                  softcap: float = 0.0, scale: Optional[float] = None, return_lse: bool = False,
                  cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                  request_id: Optional[str] = None, q_descale: Optional[float] = None,
                  k_descale: Optional[float] = None,
                  v_descale: Optional[float] = None, alibi_slopes: Any = None, sinks: Any = None,
                  bias: Any = None, mask: Any = None, block_mask: Any = None) -> _wire.Encoded:
    """The ForwardRequest for forward()'s arguments (see Client.forward), encoded."""
    tensors = [(name, _tensors.to_out(name, x)) for name, x in (("q", q), ("k", k), ("v", v))]
    req = pb.ForwardRequest(request_id=request_id or next_request_id())
    offsets = {}
    for name, cu, field in (("cu_seqlens_q", cu_seqlens_q, req.cu_seqlens_q),
                            ("cu_seqlens_k", cu_seqlens_k, req.cu_seqlens_k)):
        offsets[name] = _tensors.to_offsets(name, cu)
        if offsets[name] is not None:
            field.extend(offsets[name])
    mods = dict(alibi_slopes=alibi_slopes, sinks=sinks, bias=bias, mask=mask,
                block_mask=block_mask)
    if any(x is not None for x in mods.values()):
        call = _mods.CallShape(tensors[0][1].shape, tensors[1][1].shape,
                               offsets["cu_seqlens_q"], offsets["cu_seqlens_k"])
        tensors += _mods.apply(req.options, call, **mods)
    fill_options(req.options, causal=causal, window=window, softcap=softcap, scale=scale,
                 return_lse=return_lse)
    # FP8 inputs' descales: only sent when given (unset means 1 on the server,
    # and the server refuses them for other dtypes, naming the field).
    if q_descale is not None:
        req.options.q_descale = float(q_descale)
    if k_descale is not None:
        req.options.k_descale = float(k_descale)
    if v_descale is not None:
        req.options.v_descale = float(v_descale)
    return _wire.encode(req, tensors)


def parse_response(received: _wire.Received, like: Any) -> ForwardResult:
    """A ForwardResponse as a ForwardResult, O and LSE of like's kind (ndarray or torch)."""
    resp: pb.ForwardResponse = received.message  # all but o and lse
    if resp.error_code != 0:
        raise AttnServeError.from_code_number(resp.error_code, resp.error_message,
                                              resp.request_id)
    o, lse = outputs_of(received, like)
    return ForwardResult(o=o, lse=lse, timing=server_timing(resp.timing), backend=resp.backend,
                         request_id=resp.request_id)


def outputs_of(received: _wire.Received, like: Any,
               lease: Any = None) -> Tuple[Any, Optional[Any]]:
    """A response's O and LSE (None when the server sent none) as like's kind.

    An absent O reads as the generated class's default Tensor (DTYPE_UNSPECIFIED,
    which from_wire refuses naming the field). With `lease` (an attnserve.shm.Lease:
    the call asked for O in shared memory), O is read from the span the response names.
    """
    o = received.tensors.get("o")
    lse = received.tensors.get("lse")
    lse = None if lse is None else _tensors.from_wire("lse", lse, like)
    if lease is not None and o is not None and o.shm is not None:
        return lease.read_o(o.dtype, tuple(o.shape), o.shm, like), lse
    if lease is not None and o is not None:
        raise AttnServeError(grpc.StatusCode.INTERNAL, "o: asked for in shared memory "
                             "(output_shm.o), the server sent it without a shm span")
    return _tensors.from_wire("o", o if o is not None else pb.Tensor(), like), lse
