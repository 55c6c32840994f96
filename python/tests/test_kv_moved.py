"""attnserve.kv follows a moved cache: two CPU servers, A started with --handoff_peer=B.
SIGTERM moves A's cache to B; the Cache's next calls are answered UNAVAILABLE moved-to by A
and retried at B, with outputs checked against the float64 reference over the whole history
(nothing lost, nothing appended twice). Waits wait for A's log line, never a fixed time."""

from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest

import reference
from attnserve import Client
from attnserve.kv import Cache, _moved_to
from conftest import Server, _binary

HQ, HKV, D = 4, 2, 16


class _Error(grpc.RpcError):
    def __init__(self, code, details, trailers=()):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def test_moved_to_reads_the_trailer_or_the_message():
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert _moved_to(_Error(unavailable, "x", (("x-attnserve-moved-to", "h:1"),))) == "h:1"
    assert _moved_to(_Error(unavailable, "cache c-1 moved to 10.0.0.2:50051")) == "10.0.0.2:50051"
    assert _moved_to(_Error(unavailable, "server is draining")) is None
    assert _moved_to(_Error(grpc.StatusCode.NOT_FOUND, "cache c-1 moved to h:1")) is None


@pytest.mark.skipif(bool(os.environ.get("ATTNSERVE_TARGET")), reason="starts its own servers")
def test_cache_follows_its_move_to_the_peer():
    rng = np.random.default_rng(3)
    b = Server(_binary(), [])
    a = Server(_binary(), [f"--handoff_peer={b.target}", "--handoff_linger=10s"])
    try:
        with Client(a.target) as client, \
             Cache(client, num_layers=1, num_heads_kv=HKV, head_dim=D, dtype="float32",
                   capacity_tokens=4096) as cache, cache.sequences(1) as seqs:
            ks, vs = [], []
            for step, n in enumerate((9, 1, 1)):
                if step == 1:
                    a.proc.terminate()  # SIGTERM: A moves the cache to B, then answers moved-to
                    deadline = time.monotonic() + 60
                    while not any("handoff: moved 1 of 1" in line for line in a.log):
                        assert time.monotonic() < deadline, "".join(a.log)
                        time.sleep(0.02)  # polling A's log for the evidence
                q = rng.uniform(-1, 1, (1, n, HQ, D)).astype(np.float32)
                k = rng.uniform(-1, 1, (1, n, HKV, D)).astype(np.float32)
                v = rng.uniform(-1, 1, (1, n, HKV, D)).astype(np.float32)
                ks.append(k[0])
                vs.append(v[0])
                o = cache.append_attend(0, seqs, q, k, v, causal=True)
                want, _ = reference.attention(q, np.concatenate(ks)[None], np.concatenate(vs)[None],
                                              causal=True)
                assert np.max(np.abs(o.astype(np.float64) - want)) <= 1e-5
            assert seqs[0].lengths == [11]
            assert cache.stats().tokens == 11  # read from B
    finally:
        a.stop()
        b.stop()


@pytest.mark.skipif(bool(os.environ.get("ATTNSERVE_TARGET")), reason="starts its own servers")
def test_stream_follows_its_move_to_the_peer():
    """A stream open on A when A's cache moves: A ends it moved-to after answering what it
    had started; the stream reopens at B and sends the rest again, each future once."""
    rng = np.random.default_rng(5)
    b = Server(_binary(), [])
    a = Server(_binary(), [f"--handoff_peer={b.target}", "--handoff_linger=10s"])
    try:
        with Client(a.target) as client, \
             Cache(client, num_layers=1, num_heads_kv=HKV, head_dim=D, dtype="float32",
                   capacity_tokens=8192) as cache, cache.sequences(1) as seqs:
            ks, vs, futures = [], [], []

            def submit(s, n):
                q = rng.uniform(-1, 1, (1, n, HQ, D)).astype(np.float32)
                k = rng.uniform(-1, 1, (1, n, HKV, D)).astype(np.float32)
                v = rng.uniform(-1, 1, (1, n, HKV, D)).astype(np.float32)
                ks.append(k[0])
                vs.append(v[0])
                want, _ = reference.attention(q, np.concatenate(ks)[None],
                                              np.concatenate(vs)[None], causal=True)
                futures.append((s.submit(0, seqs, q, k, v, causal=True), want))

            with cache.stream() as s:
                for _ in range(10):
                    submit(s, 3)
                a.proc.terminate()  # SIGTERM: A moves the cache to B while calls are in flight
                for _ in range(20):
                    submit(s, 1)
                deadline = time.monotonic() + 60
                while not any("handoff: moved 1 of 1" in line for line in a.log):
                    assert time.monotonic() < deadline, "".join(a.log)
                    time.sleep(0.02)  # polling A's log for the evidence
                for _ in range(5):
                    submit(s, 2)
                for future, want in futures:
                    o = future.result(timeout=60).o
                    assert np.max(np.abs(o.astype(np.float64) - want)) <= 1e-5
                assert s.reopened >= 1
            assert seqs[0].lengths == [60]
            assert cache.stats().tokens == 60  # read from B
    finally:
        a.stop()
        b.stop()
