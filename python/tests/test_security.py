"""The client against a secured server: TLS, mutual TLS and bearer tokens.

The server is the real binary ($ATTNSERVE_SERVER) with certificates made for this
run by the build's make_test_certs ($ATTNSERVE_MAKE_TEST_CERTS): a CA, a server
certificate for localhost/127.0.0.1 and a client certificate.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from typing import Iterator, List

import grpc
import numpy as np
import pytest

from attnserve import AttnServeError, Client
from attnserve.aio import AsyncClient
from conftest import Server, _binary

TOKEN = "python-test-token-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> str:
    tool = os.environ.get("ATTNSERVE_MAKE_TEST_CERTS", "")
    if not tool or not os.access(tool, os.X_OK):
        pytest.fail(f"ATTNSERVE_MAKE_TEST_CERTS must name make_test_certs, got {tool!r}")
    d = tmp_path_factory.mktemp("certs")
    subprocess.run([tool, str(d)], check=True)
    (d / "tokens").write_text(f"{TOKEN} python-tests\n")
    return str(d)


class SecureServer(Server):
    """A Server whose readiness check speaks TLS (and presents the client certificate)."""

    def __init__(self, binary: str, extra_args: List[str], certs: str, mutual: bool):
        self._certs, self._mutual = certs, mutual
        super().__init__(binary, extra_args)
        self.target = self.target.replace("127.0.0.1", "localhost")  # the certificate's name

    def _wait_for_serving(self) -> None:
        self.target = self.target.replace("127.0.0.1", "localhost")
        kwargs = {"root_certificates": f"{self._certs}/ca.pem"}
        if self._mutual:
            kwargs.update(certificate_chain=f"{self._certs}/client.pem",
                          private_key=f"{self._certs}/client.key")
        with Client(self.target, timeout=5, max_attempts=1, **kwargs) as c:
            deadline = time.monotonic() + 120.0  # conftest's start-up bound
            while time.monotonic() < deadline:
                try:
                    if c.health() == "SERVING":
                        return
                except AttnServeError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError("attnserve exited:\n" + "".join(self.log))
                time.sleep(0.05)  # poll interval between health checks
            raise RuntimeError("attnserve never became SERVING:\n" + "".join(self.log))


@pytest.fixture(scope="module")
def tls_server(certs: str) -> Iterator[SecureServer]:
    s = SecureServer(_binary(), [f"--tls_cert={certs}/server.pem", f"--tls_key={certs}/server.key",
                                 f"--auth_tokens_file={certs}/tokens"], certs, mutual=False)
    yield s
    s.stop()


def _inputs():
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((1, 8, 2, 16)).astype(np.float32) for _ in range(3))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(16)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return q, k, v, np.einsum("bhqk,bkhd->bqhd", p, v)


def test_tls_with_token_computes(tls_server: SecureServer, certs: str) -> None:
    q, k, v, expected = _inputs()
    with Client(tls_server.target, root_certificates=f"{certs}/ca.pem", token=TOKEN) as c:
        np.testing.assert_allclose(c.forward(q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_token_from_the_environment(tls_server: SecureServer, certs: str, monkeypatch) -> None:
    monkeypatch.setenv("ATTNSERVE_TOKEN", TOKEN)
    q, k, v, expected = _inputs()
    with open(f"{certs}/ca.pem", "rb") as f:
        with Client(tls_server.target, root_certificates=f.read()) as c:
            np.testing.assert_allclose(c.forward(q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_missing_or_wrong_token_is_unauthenticated(tls_server: SecureServer, certs: str,
                                                   monkeypatch) -> None:
    monkeypatch.delenv("ATTNSERVE_TOKEN", raising=False)
    q, k, v, _ = _inputs()
    for token in (None, "not-the-token-0123456789"):
        with Client(tls_server.target, root_certificates=f"{certs}/ca.pem", token=token,
                    max_attempts=1) as c:
            with pytest.raises(AttnServeError) as e:
                c.forward(q, k, v)
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"  # health stays open


def test_plain_text_client_fails_cleanly(tls_server: SecureServer) -> None:
    q, k, v, _ = _inputs()
    with Client(tls_server.target, token=TOKEN, max_attempts=1, timeout=10) as c:
        with pytest.raises(AttnServeError) as e:
            c.forward(q, k, v)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_asyncio_client_over_tls_with_token(tls_server: SecureServer, certs: str) -> None:
    q, k, v, expected = _inputs()

    async def run():
        async with AsyncClient(tls_server.target, root_certificates=f"{certs}/ca.pem",
                               token=TOKEN) as c:
            return await c.forward(q, k, v)

    np.testing.assert_allclose(asyncio.run(run()), expected, rtol=1e-5, atol=1e-5)


def test_mutual_tls(certs: str) -> None:
    s = SecureServer(_binary(), [f"--tls_cert={certs}/server.pem", f"--tls_key={certs}/server.key",
                                 f"--tls_client_ca={certs}/ca.pem"], certs, mutual=True)
    try:
        q, k, v, expected = _inputs()
        with Client(s.target, root_certificates=f"{certs}/ca.pem",
                    certificate_chain=f"{certs}/client.pem",
                    private_key=f"{certs}/client.key") as c:
            np.testing.assert_allclose(c.forward(q, k, v), expected, rtol=1e-5, atol=1e-5)
        with Client(s.target, root_certificates=f"{certs}/ca.pem", max_attempts=1,
                    timeout=10) as c:
            with pytest.raises(AttnServeError) as e:
                c.forward(q, k, v)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ValueError, match="certificate_chain, private_key"):
            Client(s.target, root_certificates=f"{certs}/ca.pem",
                   certificate_chain=f"{certs}/client.pem")
    finally:
        s.stop()


def test_token_over_plain_text(certs: str) -> None:
    """Behind a mesh that encrypts: tokens without TLS (sync and asyncio clients)."""
    s = Server(_binary(), [f"--auth_tokens_file={certs}/tokens"])
    try:
        q, k, v, expected = _inputs()
        with Client(s.target, token=TOKEN) as c:
            np.testing.assert_allclose(c.forward(q, k, v), expected, rtol=1e-5, atol=1e-5)
        with Client(s.target, token="wrong-token-0123456789", max_attempts=1) as c:
            with pytest.raises(AttnServeError) as e:
                c.forward(q, k, v)
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED

        async def run():
            async with AsyncClient(s.target, token=TOKEN) as c:
                return await c.forward(q, k, v)

        np.testing.assert_allclose(asyncio.run(run()), expected, rtol=1e-5, atol=1e-5)
    finally:
        s.stop()
