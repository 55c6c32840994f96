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
Run it with two client versions (PYTHONPATH) to compare them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import ml_dtypes
import numpy as np

import attnserve
from attnserve import Client

SCENARIOS = {"small": (1, 256, 16, 128), "mid": (4, 512, 16, 128), "large": (4, 4096, 16, 128)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--scenario", default="small", choices=sorted(SCENARIOS))
    ap.add_argument("--rpc", default="echo", choices=["echo", "forward"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = SCENARIOS[a.scenario]
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
               for _ in range(3))
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
