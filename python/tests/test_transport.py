"""Which transport carried the calls (attnserve._transport): the one $ATTNSERVE_TRANSPORT asked for.

ctest runs the client and K/V suites twice, with ATTNSERVE_TRANSPORT=native (the
extension must have been built: gRPC C++ is there) and =grpcio; this file, run
in both, checks from the native channel's own call count that the suites'
calls went where they were sent, not just that they passed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from attnserve import AttnServeError, Client, _transport
from attnserve.kv import Cache

ASKED = os.environ.get(_transport.ENV, "auto") or "auto"


def _native_builds() -> bool:
    return _transport._native is not None


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
