#!/usr/bin/env python3
"""The K/V append-and-attend call with q, k, v and O in the message vs through same-host shared
memory (Cache(shm=True), attnserve.shm), on one running server (--allow_client_shm): per-call
wall time and this process's CPU, rounds alternated. The client's transport is the default
($ATTNSERVE_TRANSPORT chooses). Each call appends NEW tokens to B sequences and attends one
query per sequence over them (light compute: the bytes dominate), then the sequences are
truncated back (not timed), so the cache stays small.

Usage: python_shm_ab.py HOST:PORT [--batch 4 --new 256 --heads 8 --head-dim 128 --rounds 6]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attnserve import Client
from attnserve.kv import Cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of 5 calls per mode")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((a.batch, 1, a.heads, a.head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((a.batch, a.new, a.heads, a.head_dim), dtype=np.float32)
            for _ in range(2))
    mib = (2 * q.nbytes + k.nbytes + v.nbytes) / 2**20
    with Client(a.target, max_attempts=1) as c:
        print(f"transport {c.transport}; per call {mib:.1f} MiB (q, k, v in, O out), FP32, "
              f"B={a.batch} new={a.new} H={a.heads} D={a.head_dim}")
        caches = {m: Cache(c, num_layers=1, num_heads_kv=a.heads, head_dim=a.head_dim,
                           dtype="float32", capacity_tokens=1 << 14, shm=(m == "shm"))
                  for m in ("bytes", "shm")}
        seqs = {m: caches[m].sequences(a.batch) for m in caches}
        times = {m: [] for m in caches}
        for r in range(a.rounds):
            for m in ("bytes", "shm") if r % 2 == 0 else ("shm", "bytes"):
                for _ in range(5):
                    t0, c0 = time.perf_counter(), time.process_time()
                    caches[m].append_attend(0, seqs[m], q, k, v)
                    times[m].append((time.perf_counter() - t0, time.process_time() - c0))
                    for s in seqs[m]:
                        s.truncate(0)
        for m, t in times.items():
            wall = np.array([x[0] for x in t]) * 1e3
            cpu = np.array([x[1] for x in t]) * 1e3
            print(f"{m:5}: {len(t)} calls, wall p50 {np.percentile(wall, 50):.2f} ms "
                  f"(p90 {np.percentile(wall, 90):.2f}), client CPU {cpu.mean():.2f} ms/call")
        for m in caches:
            seqs[m].free()
            caches[m].close()


if __name__ == "__main__":
    main()
