#!/usr/bin/env python3
"""The "what a user would write instead" baseline for attnserve's serving benchmark.

A Python grpcio server for the same `attnserve.v1.Attention` service
(proto/attnserve/v1/attention.proto) that computes attention with PyTorch's
`torch.nn.functional.scaled_dot_product_attention` (SDPA) on one GPU. `attnctl
load` / `attnctl forward` drive it unchanged. It is meant to be a reasonable,
straightforward implementation: a thread-pool gRPC server, inputs decoded
without copies, one H2D copy per tensor, one SDPA call (PyTorch picks the
FlashAttention-2 / cuDNN / memory-efficient kernel), one D2H copy. No request
batching, no CUDA graphs, no pinned staging buffers, no per-thread streams.

Messages are the generated classes of the attnserve Python package
(`pip install ./python`: attnserve.v1.attention_pb2, made from proto/ by
grpcio-tools) and grpcio-health-checking's; they need protobuf >= 7.35.1 < 8
and grpcio >= 1.84.0 at run time. See README.md next to this file.

    python3 bench/baselines/sdpa_server.py --port=50071 --device=0
    python3 bench/baselines/sdpa_server.py --port=50071 --device=cpu   # for testing
"""

import argparse
import logging
import math
import signal
import sys
import threading
import time
import warnings
from concurrent import futures

import grpc
import torch
import torch.nn.functional as F

try:  # torch >= 2.3: bottom-right aligned causal masks that keep the fused kernels
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover
    causal_lower_right = None

from attnserve.v1 import attention_pb2 as pb
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

BACKEND = "python_sdpa"
VERSION = "sdpa_server 1.0"
SERVICE = "attnserve.v1.Attention"
HEALTH_SERVICE = "grpc.health.v1.Health"

# torch.frombuffer on the (read-only) received bytes warns once per process
# that the tensor is not writable; we never write to it. CausalBias warns that
# Sq > Sk may give NaN rows; those rows are zeroed explicitly below.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
warnings.filterwarnings("ignore", message=".*seq_len_q > seq_len_kv.*")
warnings.filterwarnings("ignore", message=".*Lower right causal bias.*")

TORCH_DTYPES = {pb.FP16: torch.float16, pb.BF16: torch.bfloat16, pb.FP32: torch.float32}
DTYPE_SIZES = {pb.FP16: 2, pb.BF16: 2, pb.FP32: 4}
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 8, 256, 8

log = logging.getLogger("sdpa_server")


def dtype_name(value):
    """The enum's name, or what an unknown value is (proto3 enums are open)."""
    return pb.DType.Name(value) if value in pb.DType.values() else f"unknown dtype {value}"


class Received:
    """A decoded request and when it arrived (queue_us starts there); `error` if undecodable."""

    __slots__ = ("req", "received_ns", "error")

    def __init__(self, req, received_ns, error=None):
        self.req, self.received_ns, self.error = req, received_ns, error


class RequestError(Exception):
    """A request the server answers with a non-OK status (never a crash)."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message):
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unimplemented(message):
    return RequestError(grpc.StatusCode.UNIMPLEMENTED, message)


def _shape(t):
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


class Spec:
    """A validated request: shapes, torch dtype, options."""

    __slots__ = ("varlen", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim",
                 "dtype", "scale", "causal", "window_left", "window_right", "cu_q", "cu_k")


def validate(req, compute=True):
    """Checks a ForwardRequest against DESIGN.md §2; returns a Spec or raises RequestError.

    compute=False (Echo) skips the UNIMPLEMENTED checks: nothing is computed.
    """
    for name in ("q", "k", "v"):
        if not req.HasField(name):
            raise invalid(f"{name}: expected a tensor, got none")
    q, k, v = req.q, req.k, req.v
    if q.dtype not in TORCH_DTYPES:
        raise invalid(f"q.dtype: expected FP16, BF16 or FP32, got "
                      f"{dtype_name(q.dtype)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise invalid(f"{name}.dtype: expected {dtype_name(q.dtype)} (q.dtype), got "
                          f"{dtype_name(t.dtype)}")
    s = Spec()
    s.varlen = bool(req.cu_seqlens_q) or bool(req.cu_seqlens_k)
    if s.varlen and not (req.cu_seqlens_q and req.cu_seqlens_k):
        missing = "cu_seqlens_k" if req.cu_seqlens_q else "cu_seqlens_q"
        raise invalid(f"{missing}: expected B+1 offsets when "
                      f"{'cu_seqlens_q' if missing == 'cu_seqlens_k' else 'cu_seqlens_k'} is set "
                      "(both or neither), got none")
    rank = 3 if s.varlen else 4
    layout = "[Tq, Hq, D] (varlen)" if s.varlen else "[B, Sq, Hq, D]"
    kv_layout = "[Tk, Hkv, D] (varlen)" if s.varlen else "[B, Sk, Hkv, D]"
    if len(q.shape) != rank:
        raise invalid(f"q.shape: expected rank {rank} {layout}, got {_shape(q)}")
    if len(k.shape) != rank:
        raise invalid(f"k.shape: expected rank {rank} like q ({kv_layout}), got {_shape(k)}")
    if len(v.shape) != rank:
        raise invalid(f"v.shape: expected rank {rank} like q ({kv_layout}), got {_shape(v)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        for i, d in enumerate(t.shape):
            if d < 0:
                raise invalid(f"{name}.shape[{i}]: expected >= 0, got {d}")
    if list(v.shape) != list(k.shape):
        raise invalid(f"v.shape: expected {_shape(k)} (the shape of k), got {_shape(v)}")
    h_axis, d_axis = rank - 2, rank - 1
    if not s.varlen and k.shape[0] != q.shape[0]:
        raise invalid(f"k.shape[0]: expected batch {q.shape[0]} (q.shape[0]), got {k.shape[0]}")
    hq, hkv, d = q.shape[h_axis], k.shape[h_axis], q.shape[d_axis]
    if hq < 1:
        raise invalid(f"q.shape[{h_axis}]: expected Hq >= 1 heads, got {hq}")
    if hkv < 1:
        raise invalid(f"k.shape[{h_axis}]: expected Hkv >= 1 heads, got {hkv}")
    if hq % hkv != 0:
        raise invalid(f"k.shape[{h_axis}]: expected Hkv dividing Hq = {hq} (GQA/MQA), got {hkv}")
    if d % HEAD_DIM_MULTIPLE or not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise invalid(f"q.shape[{d_axis}]: expected head dim D a multiple of {HEAD_DIM_MULTIPLE} "
                      f"in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d}")
    if k.shape[d_axis] != d:
        raise invalid(f"k.shape[{d_axis}]: expected head dim {d} (q.shape[{d_axis}]), "
                      f"got {k.shape[d_axis]}")
    size = DTYPE_SIZES[q.dtype]
    for name, t in (("q", q), ("k", k), ("v", v)):
        want = math.prod(t.shape) * size
        got = len(t.data)
        if got != want:
            raise invalid(f"{name}.data: expected {want} bytes (shape {_shape(t)} x {size}-byte "
                          f"{dtype_name(t.dtype)}), got {got}")
    if s.varlen:
        for name, cu, total in (("cu_seqlens_q", req.cu_seqlens_q, q.shape[0]),
                                ("cu_seqlens_k", req.cu_seqlens_k, k.shape[0])):
            if cu[0] != 0:
                raise invalid(f"{name}[0]: expected 0, got {cu[0]}")
            for i in range(1, len(cu)):
                if cu[i] < cu[i - 1]:
                    raise invalid(f"{name}[{i}]: expected non-decreasing offsets, got {cu[i]} "
                                  f"after {cu[i - 1]}")
            if cu[-1] != total:
                raise invalid(f"{name}[{len(cu) - 1}]: expected the total length {total} "
                              f"({'q' if name.endswith('q') else 'k'}.shape[0]), got {cu[-1]}")
        if len(req.cu_seqlens_k) != len(req.cu_seqlens_q):
            raise invalid(f"cu_seqlens_k: expected {len(req.cu_seqlens_q)} offsets (like "
                          f"cu_seqlens_q), got {len(req.cu_seqlens_k)}")
        s.cu_q, s.cu_k = list(req.cu_seqlens_q), list(req.cu_seqlens_k)
        s.batch = len(s.cu_q) - 1
        s.seqlen_q, s.seqlen_k = q.shape[0], k.shape[0]  # totals Tq, Tk
    else:
        s.cu_q = s.cu_k = None
        s.batch, s.seqlen_q, s.seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    s.heads_q, s.heads_kv, s.head_dim = hq, hkv, d
    s.dtype = TORCH_DTYPES[q.dtype]

    o = req.options
    if o.HasField("softmax_scale"):
        if not (math.isfinite(o.softmax_scale) and o.softmax_scale > 0):
            raise invalid(f"options.softmax_scale: expected finite and > 0, got {o.softmax_scale}")
        s.scale = o.softmax_scale
    else:
        s.scale = 1.0 / math.sqrt(d)
    for name in ("window_left", "window_right"):
        w = getattr(o, name) if o.HasField(name) else None
        if w is not None and w < 0:
            raise invalid(f"options.{name}: expected >= 0 (unset = unlimited), got {w}")
    if not (math.isfinite(o.softcap) and o.softcap >= 0):
        raise invalid(f"options.softcap: expected finite and >= 0 (0 = off), got {o.softcap}")
    # Valid, but not something SDPA does: say so instead of computing something else.
    if compute and o.softcap > 0:
        raise unimplemented("options.softcap: not supported by the python_sdpa baseline "
                            "(torch SDPA has no logit softcap); send softcap = 0")
    if compute and o.return_lse:
        raise unimplemented("options.return_lse: not supported by the python_sdpa baseline "
                            "(torch SDPA does not return the log-sum-exp); send return_lse = false")
    s.causal = o.causal
    s.window_left = o.window_left if o.HasField("window_left") else None
    # With causal the right bound is the causal one (DESIGN.md §2).
    s.window_right = o.window_right if o.HasField("window_right") and not o.causal else None
    return s


class MaskCache:
    """Per (Sq, Sk, causal, window) what SDPA gets: (attn_mask, is_causal, empty_rows).

    - no mask: (None, False, None); causal with Sq == Sk: (None, True, None), the
      fused kernels' own causal path;
    - causal with Sq < Sk (decode, chunked prefill): torch's bottom-right
      CausalBias, which keeps the fused kernels (FlashAttention-2 or the
      memory-efficient one);
    - causal with Sq > Sk, and sliding windows: a boolean [Sq, Sk] mask (True =
      attend), built once and kept on the device; rows without any key (for
      causal, i < Sq - Sk) are zeroed. Not CausalBias for Sq > Sk: on CUDA with
      torch 2.11 its memory-efficient path (FP32, or no GQA with a dtype/head
      dim flash refuses) returns wrong values in rows that do see keys (seen on
      an H100: max error ~3 against float64), and torch warns about that case.
    A row that sees no key must give O = 0 (DESIGN.md §2); SDPA may give NaN.
    """

    def __init__(self, device, max_entries=64):
        self.device = device
        self.max_entries = max_entries
        self.lock = threading.Lock()
        self.entries = {}

    def get(self, sq, sk, causal, wl, wr):
        if wl is None and wr is None:
            if not causal:
                return None, False, None
            if sq == sk:
                return None, True, None
        key = (sq, sk, causal, wl, wr)
        with self.lock:
            hit = self.entries.get(key)
        if hit is not None:
            return hit
        if wl is None and wr is None and causal_lower_right is not None and sq < sk:
            mask, empty = causal_lower_right(sq, sk), None
        else:
            i = torch.arange(sq, device=self.device).view(sq, 1) + (sk - sq)
            j = torch.arange(sk, device=self.device).view(1, sk)
            mask = torch.ones(sq, sk, dtype=torch.bool, device=self.device)
            if wl is not None:
                mask &= j >= i - wl
            right = 0 if causal else wr
            if right is not None:
                mask &= j <= i + right
            empty = ~mask.any(dim=1)
            if not bool(empty.any()):
                empty = None
        entry = (mask, False, empty)
        with self.lock:
            if len(self.entries) >= self.max_entries:
                self.entries.pop(next(iter(self.entries)))
            self.entries[key] = entry
        return entry


class SdpaAttention:
    """The Attention service: decode → validate → H2D → SDPA → D2H → encode."""

    def __init__(self, device, max_message_bytes, workers):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.max_message_bytes = max_message_bytes
        self.workers = workers
        self.masks = MaskCache(device)
        self.draining = False

    # ---- helpers -------------------------------------------------------

    def _sync(self):
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _to_device(self, t, dtype):
        if math.prod(t.shape) == 0:
            return torch.empty(tuple(t.shape), dtype=dtype, device=self.device)
        # A view of the received message (no copy), then one copy to the device.
        host = torch.frombuffer(t.data, dtype=dtype).view(tuple(t.shape))
        return host.to(self.device, non_blocking=True)

    def _attend(self, q, k, v, s):
        """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] on the device → o [B, Sq, Hq, D]."""
        b, sq, hq, _ = q.shape
        sk = k.shape[1]
        if b == 0 or sq == 0:
            return torch.empty_like(q)
        if sk == 0:
            return torch.zeros_like(q)  # no key at all: O = 0
        mask, is_causal, empty = self.masks.get(sq, sk, s.causal, s.window_left, s.window_right)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=is_causal, scale=s.scale,
            enable_gqa=hq != k.shape[2])
        o = o.transpose(1, 2)
        if empty is not None:
            o = o.masked_fill(empty.view(1, sq, 1, 1), 0)
        return o

    def _compute(self, req, s):
        """Returns (o host tensor, h2d_us, compute_us, d2h_us)."""
        t0 = time.perf_counter_ns()
        q = self._to_device(req.q, s.dtype)
        k = self._to_device(req.k, s.dtype)
        v = self._to_device(req.v, s.dtype)
        self._sync()
        t1 = time.perf_counter_ns()
        if not s.varlen:
            o = self._attend(q, k, v, s)
        else:
            o = torch.empty_like(q)
            for i in range(s.batch):  # one SDPA call per sequence
                q0, q1, k0, k1 = s.cu_q[i], s.cu_q[i + 1], s.cu_k[i], s.cu_k[i + 1]
                if q1 > q0:
                    o[q0:q1] = self._attend(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], s)[0]
        o = o.contiguous()
        self._sync()
        t2 = time.perf_counter_ns()
        o_host = o.cpu()
        t3 = time.perf_counter_ns()
        if not self.is_cuda:
            return o_host, 0, (t3 - t0) // 1000, 0
        return o_host, (t1 - t0) // 1000, (t2 - t1) // 1000, (t3 - t2) // 1000

    def _run(self, received, context):
        """One request → ForwardResponse; raises RequestError."""
        if received.error is not None:
            raise invalid(f"request: not a valid attnserve.v1.ForwardRequest ({received.error})")
        req = received.req
        start_ns = time.perf_counter_ns()
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is draining for shutdown")
        s = validate(req)
        if context is not None and not context.is_active():
            raise RequestError(grpc.StatusCode.CANCELLED, "request cancelled or past its deadline "
                               "before compute started")
        try:
            with torch.inference_mode():
                o, h2d_us, compute_us, d2h_us = self._compute(req, s)
        except torch.cuda.OutOfMemoryError as e:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"device memory exhausted: {str(e).splitlines()[0]}") from e
        # protobuf takes only bytes: one copy here, one more when it is stored.
        data = o.view(torch.uint8).numpy().tobytes() if o.numel() else b""
        end_ns = time.perf_counter_ns()
        timing = pb.ServerTiming(
            queue_us=max(0, start_ns - received.received_ns) // 1000,
            host_to_device_us=h2d_us, compute_us=compute_us, device_to_host_us=d2h_us,
            total_us=max(0, end_ns - received.received_ns) // 1000, batch_size=1)
        return pb.ForwardResponse(
            request_id=req.request_id,
            o=pb.Tensor(dtype=req.q.dtype, shape=list(req.q.shape), data=data),
            timing=timing, backend=BACKEND)

    def _echo(self, received):
        """Echo: Forward's validation, then q's bytes back as o; no device, no compute."""
        if received.error is not None:
            raise invalid(f"request: not a valid attnserve.v1.ForwardRequest ({received.error})")
        req = received.req
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is draining for shutdown")
        s = validate(req, compute=False)
        lse = None
        if req.options.return_lse:
            shape = ([s.heads_q, s.seqlen_q] if s.varlen
                     else [s.batch, s.heads_q, s.seqlen_q])
            lse = pb.Tensor(dtype=pb.FP32, shape=shape, data=bytes(4 * math.prod(shape)))
        total_us = max(0, time.perf_counter_ns() - received.received_ns) // 1000
        resp = pb.ForwardResponse(
            request_id=req.request_id,
            o=pb.Tensor(dtype=req.q.dtype, shape=list(req.q.shape), data=req.q.data),
            timing=pb.ServerTiming(total_us=total_us, batch_size=1), backend=BACKEND)
        if lse is not None:
            resp.lse.CopyFrom(lse)
        return resp

    # ---- RPCs ----------------------------------------------------------

    def echo(self, req, context):
        try:
            return self._echo(req)
        except RequestError as e:
            context.abort(e.code, e.message)

    def forward(self, req, context):
        try:
            return self._run(req, context)
        except RequestError as e:
            context.abort(e.code, e.message)
        except Exception as e:  # a bug or a device error: INTERNAL, keep serving
            log.exception("Forward failed")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    def forward_stream(self, requests, context):
        # Pipelined on the wire, processed in order on this worker thread; a
        # failed request yields a response with error_code and the stream goes on.
        for req in requests:
            request_id = req.req.request_id if req.error is None else ""
            try:
                yield self._run(req, context)
            except RequestError as e:
                yield pb.ForwardResponse(request_id=request_id, backend=BACKEND,
                                         error_code=e.code.value[0], error_message=e.message)
            except Exception as e:
                log.exception("ForwardStream request failed")
                yield pb.ForwardResponse(request_id=request_id, backend=BACKEND,
                                         error_code=grpc.StatusCode.INTERNAL.value[0],
                                         error_message=f"{type(e).__name__}: {e}")

    def get_server_info(self, _req, _context):
        devices = []
        if self.is_cuda:
            p = torch.cuda.get_device_properties(self.device)
            devices.append(pb.DeviceInfo(
                index=self.device.index, name=p.name, compute_capability_major=p.major,
                compute_capability_minor=p.minor, total_memory_bytes=p.total_memory))
        return pb.GetServerInfoResponse(
            version=f"{VERSION} (torch {torch.__version__}, grpcio {grpc.__version__}, "
                    f"device {self.device})",
            backend=BACKEND, devices=devices, dtypes=[pb.FP16, pb.BF16, pb.FP32],
            min_head_dim=MIN_HEAD_DIM, max_head_dim=MAX_HEAD_DIM,
            head_dim_multiple=HEAD_DIM_MULTIPLE,
            limits=pb.ServerLimits(max_request_bytes=self.max_message_bytes),
            features=["causal", "sliding_window", "gqa", "varlen", "forward_stream", "echo"],
            cpu_threads=0 if self.is_cuda else torch.get_num_threads())

    def health_check(self, req, context):
        if req.service not in ("", SERVICE):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{req.service}'")
        status = health_pb2.HealthCheckResponse
        return status(status=status.NOT_SERVING if self.draining else status.SERVING)


def _request_decoder(data):
    """Request deserializer: never raises, so a malformed message becomes INVALID_ARGUMENT."""
    received = time.perf_counter_ns()
    try:
        return Received(pb.ForwardRequest.FromString(data), received)
    except DecodeError as e:
        return Received(None, received, e)


def _lenient(decode):
    def wrapped(data):
        try:
            return decode(data)
        except DecodeError:
            return decode(b"")
    return wrapped


def make_server(service, port, bind, workers, max_message_bytes):
    """Builds (does not start) the grpc.server; returns (server, bound port)."""
    attention = grpc.method_handlers_generic_handler(SERVICE, {
        "Forward": grpc.unary_unary_rpc_method_handler(
            service.forward, request_deserializer=_request_decoder,
            response_serializer=pb.ForwardResponse.SerializeToString),
        "ForwardStream": grpc.stream_stream_rpc_method_handler(
            service.forward_stream, request_deserializer=_request_decoder,
            response_serializer=pb.ForwardResponse.SerializeToString),
        "Echo": grpc.unary_unary_rpc_method_handler(
            service.echo, request_deserializer=_request_decoder,
            response_serializer=pb.ForwardResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            service.get_server_info,
            request_deserializer=_lenient(pb.GetServerInfoRequest.FromString),
            response_serializer=pb.GetServerInfoResponse.SerializeToString),
    })
    health = grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
        "Check": grpc.unary_unary_rpc_method_handler(
            service.health_check, request_deserializer=_lenient(health_pb2.HealthCheckRequest.FromString),
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
    })
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
        handlers=[attention, health],
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes)])
    bound = server.add_insecure_port(f"{bind}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen on {bind}:{port}")
    return server, bound


def parse_device(text):
    text = text.strip()
    if text == "cpu":
        return torch.device("cpu")
    index = text[len("cuda:"):] if text.startswith("cuda:") else text
    if not index.isdigit():
        raise argparse.ArgumentTypeError(f"expected a CUDA device index, cuda:N or cpu, got '{text}'")
    return torch.device("cuda", int(index))


def warm_up(device):
    """One small call per dtype so the first request does not pay CUDA/kernel start-up."""
    with torch.inference_mode():
        for dtype in TORCH_DTYPES.values():
            x = torch.randn(1, 2, 64, 64, device=device, dtype=dtype)
            F.scaled_dot_product_attention(x, x, x, is_causal=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Baseline attnserve.v1.Attention server: grpcio + torch SDPA on one device "
                    "(bench/baselines/README.md).")
    ap.add_argument("--port", type=int, default=50071, help="TCP port (0 = pick one; printed)")
    ap.add_argument("--bind", default="[::]", help="address to listen on (default [::])")
    ap.add_argument("--device", type=parse_device, default="0",
                    help="CUDA device index (e.g. 0), cuda:N, or cpu (testing)")
    ap.add_argument("--workers", type=int, default=16,
                    help="ThreadPoolExecutor threads: unary calls in progress at once; each open "
                         "ForwardStream holds one for its lifetime (default 16)")
    ap.add_argument("--max_message_bytes", type=int, default=1 << 30,
                    help="gRPC receive/send message limit (default 1 GiB; a B=4 N=4096 H=16 "
                         "D=128 bf16 request is ~200 MB)")
    ap.add_argument("--cpu_threads", type=int, default=0,
                    help="torch.set_num_threads for --device=cpu (0 = torch's default)")
    ap.add_argument("--log_level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if not 0 < args.max_message_bytes < 1 << 31:
        ap.error("--max_message_bytes must be in [1, 2^31)")

    device = args.device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device: CUDA is not available (use --device=cpu to test without a GPU)")
        if device.index >= torch.cuda.device_count():
            ap.error(f"--device: index {device.index} but only {torch.cuda.device_count()} "
                     "GPU(s)")
        torch.cuda.set_device(device)
    elif args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    warm_up(device)

    service = SdpaAttention(device, args.max_message_bytes, args.workers)
    server, port = make_server(service, args.port, args.bind, args.workers,
                               args.max_message_bytes)
    server.start()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log.info("%s serving %s on %s:%d (device %s: %s, torch %s, grpcio %s, %d workers)", VERSION,
             SERVICE, args.bind, port, device, name, torch.__version__, grpc.__version__,
             args.workers)
    sys.stdout.flush()

    stopped = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: draining", signum)
        service.draining = True
        stopped.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stopped.wait(3600):
        pass
    server.stop(grace=10).wait()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
