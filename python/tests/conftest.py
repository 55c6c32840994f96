"""pytest fixtures: a real attnserve server (CPU backend) on a free port, and clients of it.

The server binary comes from $ATTNSERVE_SERVER (ctest sets it to the build's
server/attnserve). With $ATTNSERVE_TARGET (host:port) the suites use that
running server instead (scripts/device/gpu-python.sh: the CUDA server). The fixture waits for evidence, never a fixed time: the
"listening on HOST:PORT" log line, then grpc.health.v1 answering SERVING.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from typing import Iterator, List

import pytest

from attnserve import AttnServeError, Client

_LISTENING = re.compile(r"listening on [^ ]*:(\d+) ")
_START_TIMEOUT_S = 120.0  # a loaded 2-core CI machine


class Server:
    """A running attnserve process and its address."""

    def __init__(self, binary: str, extra_args: List[str]):
        self.log: List[str] = []
        self.proc = subprocess.Popen(
            [binary, "--host=127.0.0.1", "--port=0", "--metrics_port=0", "--http_port=0", "--backend=cpu",
             "--threads=2", *extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        port = self._wait_for_port()
        self.target = f"127.0.0.1:{port}"
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_for_serving()

    def _wait_for_port(self) -> int:
        for line in self.proc.stdout:  # ends when the process exits
            self.log.append(line)
            m = _LISTENING.search(line)
            if m:
                return int(m.group(1))
        raise RuntimeError("attnserve exited before listening:\n" + "".join(self.log))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_for_serving(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        with Client(self.target, timeout=5, max_attempts=1) as c:
            while True:
                try:
                    if c.health() == "SERVING":
                        return
                except AttnServeError:
                    if time.monotonic() > deadline:
                        raise
                if self.proc.poll() is not None:
                    raise RuntimeError("attnserve exited:\n" + "".join(self.log))
                time.sleep(0.05)  # poll interval between health checks, not a wait for readiness

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _binary() -> str:
    binary = os.environ.get("ATTNSERVE_SERVER", "")
    if not binary or not os.access(binary, os.X_OK):
        pytest.fail(f"ATTNSERVE_SERVER must name the attnserve binary, got {binary!r}")
    return binary


class Running:
    """A server someone else started ($ATTNSERVE_TARGET), once it answers SERVING."""

    def __init__(self, target: str):
        self.target = target
        with Client(target, timeout=30) as c:
            status = c.health()
        if status != "SERVING":
            pytest.fail(f"ATTNSERVE_TARGET={target} answers {status}, not SERVING")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    target = os.environ.get("ATTNSERVE_TARGET", "")
    if target:
        yield Running(target)
        return
    s = Server(_binary(), [])
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.target) as c:
        yield c
