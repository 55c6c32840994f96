"""Which transport carried the calls (attnserve._transport): the one $ATTNSERVE_TRANSPORT asked for.

ctest runs the client and K/V suites twice, with ATTNSERVE_TRANSPORT=native (the
extension must have been built: gRPC C++ is there) and =grpcio; this file, run
in both, checks from the native channel's own call count that the suites'
calls went where they were sent, not just that they passed: the blocking unary
calls, both streams, and AsyncClient's unary calls and streams. It also holds
what only the streams' transports differ in: a stream cancelled or its channel
closed with requests pending, arrays reused after submit(), an awaited call
cancelled.
"""

from __future__ import annotations

import asyncio
import os
import threading

import grpc
import numpy as np
import pytest

from attnserve import AsyncClient, AttnServeError, Client, _transport
from attnserve.kv import Cache
from attnserve.kv_aio import AsyncCache

ASKED = os.environ.get(_transport.ENV, "auto") or "auto"


def _native_builds() -> bool:
    return _transport._native is not None


def _expect_native() -> bool:
    return ASKED == "native" or (ASKED == "auto" and _native_builds())


def test_the_asked_transport_carries_forward_echo_and_append_attend(server):
    with Client(server.target) as c:
        expect_native = ASKED == "native" or (ASKED == "auto" and _native_builds())
        assert c.transport == ("native" if expect_native else "grpcio")
        x = np.ones((1, 8, 2, 16), np.float32)
        c.forward(x, x, x)
        c.echo(x, x, x)
        with Cache(c, num_layers=1, num_heads_kv=2, head_dim=16, dtype="float32",
                   capacity_tokens=64) as cache, cache.sequence() as seq:
            cache.append_attend(0, [seq], x[0], x[0], x[0])
        with pytest.raises(AttnServeError) as e:  # a failed call counts as well
            c.forward(x, x[:, :, :1], x)
        assert "k" in e.value.message
        if expect_native:
            assert c._native.calls == 4
        else:
            assert c._native is None


def test_native_needs_a_plain_text_channel_without_a_token(server):
    # The native channel has no TLS or token support: those clients use grpcio.
    with Client(server.target, token="not-checked-by-this-server") as c:
        assert c.transport == "grpcio"


def test_native_refused_when_it_was_not_built(server, monkeypatch):
    monkeypatch.setattr(_transport, "_native", None)
    monkeypatch.setattr(_transport, "_NATIVE_MISSING", "built without gRPC C++")
    monkeypatch.setenv(_transport.ENV, "native")
    with pytest.raises(RuntimeError, match="ATTNSERVE_TRANSPORT=native.*built without gRPC C"):
        Client(server.target)
    monkeypatch.setenv(_transport.ENV, "auto")
    with Client(server.target) as c:
        assert c.transport == "grpcio"


def test_an_unknown_choice_names_the_variable(server, monkeypatch):
    monkeypatch.setenv(_transport.ENV, "fast")
    with pytest.raises(ValueError, match=r"\$ATTNSERVE_TRANSPORT: expected one of auto, "
                                         r"native, grpcio, got 'fast'"):
        Client(server.target)


def test_the_asked_transport_carries_both_streams(server):
    x = np.ones((1, 8, 2, 16), np.float32)
    with Client(server.target) as c:
        with c.stream() as s:
            assert s.transport == c.transport
            futures = [s.submit(x, x, x) for _ in range(3)]
            assert all(f.result(timeout=60).o.shape == x.shape for f in futures)
        with Cache(c, num_layers=1, num_heads_kv=2, head_dim=16, dtype="float32",
                   capacity_tokens=64) as cache, cache.sequence() as seq:
            with cache.stream() as s:
                assert s.transport == c.transport
                s.submit(0, [seq], x[0], x[0], x[0]).result(timeout=60)
        if _expect_native():
            assert c.transport == "native" and c._native.calls == 2  # a stream is one call
        else:
            assert c._native is None


def test_the_asked_transport_carries_async_unary_and_streams(server):
    x = np.ones((1, 8, 2, 16), np.float32)

    async def run():
        async with AsyncClient(server.target) as c:
            assert c.transport == ("native" if _expect_native() else "grpcio")
            await asyncio.gather(c.forward(x, x, x), c.echo(x, x, x))
            async with c.stream() as s:
                assert s.transport == c.transport
                await (await s.submit(x, x, x))
            async with AsyncCache.create(c, num_layers=1, num_heads_kv=2, head_dim=16,
                                         dtype="float32", capacity_tokens=64) as cache, \
                    cache.sequence() as seq:
                await cache.append_attend(0, [seq], x[0], x[0], x[0])
                async with cache.stream() as s:
                    assert s.transport == c.transport
                    await s.append_attend(0, [seq], x[0], x[0], x[0])
            with pytest.raises(AttnServeError) as e:
                await c.forward(x, x[:, :, :1], x)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "k" in e.value.message
            # forward, echo, append_attend, the refused forward; two streams
            return None if c._native is None else c._native.calls

    calls = asyncio.run(run())
    assert calls == (6 if _expect_native() else None)


def test_a_stream_copies_the_request_at_submit(client):
    # The caller may reuse its arrays once submit() returned, whichever transport sends.
    x = np.ones((1, 8, 2, 16), np.float32)
    with client.stream() as s:
        futures = []
        for i in range(8):
            x[...] = i
            futures.append(s.submit(x, x, x))
        x[...] = -1
        for i, f in enumerate(futures):
            assert np.all(f.result(timeout=60).o == i)


def test_a_cancelled_stream_fails_its_pending_futures(client):
    big = np.ones((1, 512, 4, 64), np.float32)
    s = client.stream()
    futures = [s.submit(big, big, big) for _ in range(16)]
    s.cancel()
    outcomes = []
    for f in futures:
        try:
            f.result(timeout=60)
            outcomes.append("ok")
        except AttnServeError as e:
            outcomes.append(e.code)
    # Those answered before the cancel succeeded; every other one was told.
    assert set(outcomes) <= {"ok", grpc.StatusCode.CANCELLED}
    with pytest.raises(AttnServeError):
        s.submit(big, big, big)


def test_closing_the_client_ends_its_streams(server):
    big = np.ones((1, 512, 4, 64), np.float32)
    c = Client(server.target)
    s = c.stream()
    futures = [s.submit(big, big, big) for _ in range(8)]
    c.close()
    for f in futures:  # each resolves (answered, or failed): none hangs
        try:
            f.result(timeout=60)
        except AttnServeError as e:
            assert e.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    s.close()


def test_an_async_stream_cancelled_and_an_awaited_call_cancelled(server):
    big = np.ones((1, 512, 4, 64), np.float32)

    async def run():
        async with AsyncClient(server.target) as c:
            s = c.stream()
            futures = [await s.submit(big, big, big) for _ in range(16)]
            await s.cancel()
            results = await asyncio.gather(*futures, return_exceptions=True)
            for r in results:
                assert not isinstance(r, BaseException) or (
                    isinstance(r, AttnServeError) and r.code == grpc.StatusCode.CANCELLED)
            task = asyncio.ensure_future(c.forward(big, big, big))
            await asyncio.sleep(0)  # started: its request is on its way
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The channel still serves after both.
            assert (await c.echo(big, big, big)).o.shape == big.shape

    asyncio.run(run())


def test_a_client_closed_from_a_completion_callback(server):
    # On the native transport a stream's futures resolve on the channel's completion
    # thread; a callback that closes the client there must neither hang nor crash.
    if not _expect_native():
        pytest.skip("the grpcio transport resolves futures on its own reader thread")
    x = np.ones((1, 8, 2, 16), np.float32)
    c = Client(server.target)
    s = c.stream()
    pending = [s.submit(x, x, x) for _ in range(4)]
    closed = threading.Event()

    def close_client(_):
        c.close()
        closed.set()
    pending[0].add_done_callback(close_client)
    assert closed.wait(timeout=60)
    for f in pending:  # answered before the close, or failed by it: none hangs
        try:
            f.result(timeout=60)
        except AttnServeError as e:
            assert e.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    s.close()  # returns: the stream ended with the channel
    with pytest.raises(AttnServeError):
        s.submit(x, x, x)
    with Client(server.target) as again:  # the process's other channels are unaffected
        assert again.echo(x, x, x).o.shape == x.shape


def test_a_stream_closed_from_its_own_future_callback(client):
    # close() from a callback (on the native transport, the completion thread) returns.
    x = np.ones((1, 8, 2, 16), np.float32)
    s = client.stream()
    closed = threading.Event()
    first = s.submit(x, x, x)
    first.add_done_callback(lambda f: (s.close(), closed.set()))
    assert closed.wait(timeout=60) and first.result(timeout=60).o.shape == x.shape
    s.close()
    assert client.echo(x, x, x).o.shape == x.shape
