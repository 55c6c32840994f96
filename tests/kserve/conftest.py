# Starts real attnserve servers (the binary ctest names in ATTNSERVE_BIN) on
# free ports for the tritonclient tests, and waits for evidence that they
# serve: the port in the "listening on" log line, then ServerReady.
import os
import re
import socket
import subprocess
import threading
import time

import pytest
import tritonclient.grpc as grpcclient

STARTUP_TIMEOUT_S = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra):
        self.http_port = free_port()
        args = [os.environ["ATTNSERVE_BIN"], "--host=127.0.0.1", "--port=0", "--backend=cpu",
                "--threads=1", "--metrics_port=0", f"--http_port={self.http_port}", *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.log = []
        found = threading.Event()
        self.grpc_port = None

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
                if m:
                    self.grpc_port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(STARTUP_TIMEOUT_S) or self.grpc_port is None:
            self.stop()
            raise RuntimeError("attnserve did not start:\n" + "".join(self.log))
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.http_url = f"127.0.0.1:{self.http_port}"
        client = grpcclient.InferenceServerClient(self.grpc_url)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not client.is_server_ready():
            if time.monotonic() > deadline:
                raise RuntimeError("attnserve never became ready")
            time.sleep(0.05)  # polling ServerReady: the evidence waited for

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


@pytest.fixture(scope="session")
def server():
    s = Server("--allow_client_shm")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def server_without_shm():
    s = Server()
    yield s
    s.stop()
