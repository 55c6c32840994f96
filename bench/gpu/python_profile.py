#!/usr/bin/env python3
"""Where one Python client call's time goes: cProfile over a loop of calls on one thread.

Against a running server (any backend); Echo by default so the server's compute
does not hide the client. Prints the wall time per call, then the functions by
their own time (tottime), so protobuf (SerializeToString, FromString, field
sets), NumPy conversion, attnserve's own encoding and grpc's blocking call
(the C core, its copies and the network wait, which cProfile sees as one
entry) stand apart.

Usage:
  python3 bench/gpu/python_profile.py --target=127.0.0.1:50051 [--scenario=large]
      [--rpc=echo|forward] [--calls=50] [--top=25]
  python3 bench/gpu/python_profile.py --gil [--scenario=large] [--calls=5]
  python3 bench/gpu/python_profile.py --ladder --target=... [--scenario=small] [--calls=300]
Run it with two client versions (PYTHONPATH) to compare them.
--gil (no server): builds the scenario's request --calls times while a second
Python thread counts; the count's rate during the builds against its rate alone
says how much of building a request holds the GIL (other callers' threads wait
that long).
--ladder: this process's CPU time per call (all threads, user and system, and
its minor page faults) for the steps of a call, each alone over --calls calls,
on each transport (attnserve._transport): building the request; the transport
with a request built once (grpcio: the joined bytes through an identity codec,
so nothing of ours runs; also on grpc.aio, the calls awaited one after another
in one coroutine; native: the pieces); the whole echo()/forward(); and a tiny
request (B 1, N 1, H 1, D 8: the fixed cost of a call). --worker-thread runs
each step's calls on a second thread, as python_bench.py's callers are: glibc
gives such a thread its own malloc arena, which hands freed memory back to the
system less eagerly than the main thread's heap (so grpcio's fresh multi-MB
buffers are mostly not faulted in anew on each call there). CPU per call,
not wall time, because the 2-core development machine is shared and loaded.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import sys
import time

import threading

import ml_dtypes
import numpy as np

import attnserve
from attnserve import Client, _request, _transport

SCENARIOS = {"small": (1, 256, 16, 128), "mid": (4, 512, 16, 128), "large": (4, 4096, 16, 128)}


def spin_rate(seconds: float, work=None) -> tuple:
    """(work's seconds, counts per second of a second thread meanwhile)."""
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1
    t = threading.Thread(target=spin)
    t.start()
    t0 = time.perf_counter()
    if work is None:
        time.sleep(seconds)
    else:
        work()
    elapsed = time.perf_counter() - t0
    stop[0] = True
    t.join()
    return elapsed, count[0] / elapsed


def gil_probe(q, k, v, calls: int) -> None:
    for _ in range(2):  # alternate, so a change in the machine's load shows
        _, alone = spin_rate(1.0)
        elapsed, during = spin_rate(0, lambda: [_request.build_request(q, k, v)
                                                for _ in range(calls)])
        print(f"build_request: {elapsed / calls * 1e3:.1f} ms each; a second thread ran at "
              f"{during:.3g}/s meanwhile, {alone:.3g}/s alone ({during / alone:.0%})")


class Usage:
    """This process's CPU (user + system, all threads), minor faults and wall time from
    construction to report()."""

    def __init__(self):
        self.r0, self.c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        self.t0 = time.perf_counter()

    def report(self, calls: int) -> str:
        c1, t1, r1 = time.process_time(), time.perf_counter(), resource.getrusage(
            resource.RUSAGE_SELF)
        per = 1e3 / calls
        return (f"cpu {(c1 - self.c0) * per:8.3f} ms (user "
                f"{(r1.ru_utime - self.r0.ru_utime) * per:.3f} sys "
                f"{(r1.ru_stime - self.r0.ru_stime) * per:.3f}) faults "
                f"{(r1.ru_minflt - self.r0.ru_minflt) / calls:6.0f}  wall "
                f"{(t1 - self.t0) * per:8.3f} ms")


def cpu_per_call(fn, calls: int, worker_thread: bool = False) -> str:
    """fn's cost per call in this process (Usage), after 3 calls of warm-up."""
    if worker_thread:
        out = []
        t = threading.Thread(target=lambda: out.append(cpu_per_call(fn, calls)))
        t.start()
        t.join()
        return out[0]
    for _ in range(3):
        fn()
    usage = Usage()
    for _ in range(calls):
        fn()
    return usage.report(calls)


def aio_floor(target: str, path: str, data: bytes, calls: int) -> str:
    """cpu_per_call's line for grpc.aio with data sent as is, awaited in one coroutine."""
    import asyncio

    import grpc.aio

    async def run() -> str:
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        async with grpc.aio.insecure_channel(target, options) as ch:
            method = ch.unary_unary(path, request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
            for _ in range(3):
                await method(data)
            usage = Usage()
            for _ in range(calls):
                await method(data)
            return usage.report(calls)
    return asyncio.run(run())


def ladder(target: str, rpc: str, q, k, v, calls: int, worker_thread: bool) -> None:
    method = "Echo" if rpc == "echo" else "Forward"
    path = f"/attnserve.v1.Attention/{method}"
    tiny = np.ones((1, 1, 1, 8), q.dtype)
    print(f"{'build_request':<40} {cpu_per_call(lambda: _request.build_request(q, k, v), calls)}",
          flush=True)
    for transport in ("grpcio", "native"):
        os.environ[_transport.ENV] = transport  # read when a Client is made
        try:
            c = Client(target, timeout=600)
        except RuntimeError as e:  # native not built here
            print(f"{transport}: {e}")
            continue
        finally:
            del os.environ[_transport.ENV]
        call = c.echo if rpc == "echo" else c.forward
        req, small = _request.build_request(q, k, v), _request.build_request(tiny, tiny, tiny)
        if transport == "grpcio":
            raw = c.channel.unary_unary(path, request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
            data, small_data = req.data, small.data
            steps = [("transport, request built once", lambda: raw(data)),
                     ("tiny request, transport only", lambda: raw(small_data))]
            print(f"{'grpcio aio: transport, request built once':<40} "
                  f"{aio_floor(target, path, data, calls)}", flush=True)
        else:
            steps = [("transport, request built once",
                      lambda: c._native.unary(path, req.pieces, None, None)),
                     ("tiny request, transport only",
                      lambda: c._native.unary(path, small.pieces, None, None))]
        steps.append((f"{rpc}() (all of it)", lambda: call(q, k, v)))
        for name, fn in steps:
            print(f"{transport + ': ' + name:<40} {cpu_per_call(fn, calls, worker_thread)}",
                  flush=True)
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--gil", action="store_true", help="no server: the GIL probe above")
    ap.add_argument("--ladder", action="store_true", help="CPU per call, step by step (above)")
    ap.add_argument("--worker-thread", action="store_true", help="--ladder: calls on a second "
                    "thread (above)")
    ap.add_argument("--scenario", default="small", choices=sorted(SCENARIOS))
    ap.add_argument("--rpc", default="echo", choices=["echo", "forward"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = SCENARIOS[a.scenario]
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    if a.gil:
        print(f"attnserve {attnserve.__file__}: {a.scenario} {shape} bf16")
        gil_probe(q, k, v, a.calls)
        return 0
    if not a.target:
        ap.error("--target (or --gil)")
    if a.ladder:
        print(f"attnserve {attnserve.__file__}: {a.rpc} {a.scenario} {shape} bf16, {a.calls} calls "
              f"each{' on a worker thread' if a.worker_thread else ''}, load average "
              f"{os.getloadavg()[0]:.1f}")
        ladder(a.target, a.rpc, q, k, v, a.calls, a.worker_thread)
        return 0
    with Client(a.target, timeout=600) as c:
        call = c.echo if a.rpc == "echo" else c.forward
        for _ in range(3):  # connection, first-call setup
            call(q, k, v)
        t0 = time.perf_counter()
        for _ in range(a.calls):
            call(q, k, v)
        plain = (time.perf_counter() - t0) / a.calls
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(a.calls):
            call(q, k, v)
        prof.disable()
        profiled = (time.perf_counter() - t0) / a.calls
    mb = 3 * q.nbytes / 1e6
    print(f"attnserve {attnserve.__file__}: {a.rpc} {a.scenario} {shape} bf16 "
          f"({mb:.1f} MB out): {plain * 1e3:.3f} ms/call ({profiled * 1e3:.3f} profiled), "
          f"{a.calls} calls")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
