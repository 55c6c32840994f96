#!/usr/bin/env python3
"""The soak test's hostile HTTP clients (scripts/soak.sh runs it beside
soak_load): for DURATION seconds against the server's KServe HTTP port it
keeps SLOW_CLIENTS slow-loris connections open (a header byte a second, each
replaced when the server closes it), and in turn sends
  - a body announced far over the limit (Content-Length 4 GiB): a 4xx before
    the body is read;
  - a deeply nested JSON body (100,000 '['): a 4xx naming the depth;
  - an oversized JSON body (OVERSIZED_MIB MiB of data values): a 4xx;
  - a request with two Authorization headers: a 4xx when the server checks
    tokens, otherwise any answer under 500;
and once a second a readiness probe, which must answer 200 within
PROBE_TIMEOUT_S however many slow clients there are.

    soak_hostile.py HOST PORT DURATION_S [SLOW_CLIENTS]

Prints one line per kind (sent, answered by status) and exits 1 when any
answer was 5xx, a hostile request was accepted (2xx where a 4xx is due), or
a probe failed. Standard library only (raw sockets).
"""
import collections
import socket
import sys
import time

PROBE_TIMEOUT_S = 5.0
OVERSIZED_MIB = 8
INFER = "/v2/models/attention/infer"


def request_bytes(method, path, headers, body=b""):
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: soak"]
    lines += ["%s: %s" % (k, v) for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_of(sock, timeout):
    """The status code of the answer on sock, or None (no answer in time)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    parts = data.split(b" ", 2)
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


def send(host, port, payload, timeout=30.0):
    """Sends payload on a fresh connection; the answer's status or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(payload)
            return status_of(s, timeout)
    except OSError:
        # The server may close while a large body is still being sent, after
        # answering: read what it said.
        return None


def send_large(host, port, head, body_len, chunk, timeout=30.0):
    """Sends head, then body_len bytes of chunk-sized pieces, stopping when the
    server answers or closes; the status or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(head)
            sent = 0
            try:
                while sent < body_len:
                    piece = chunk[:min(len(chunk), body_len - sent)]
                    s.sendall(piece)
                    sent += len(piece)
            except OSError:
                pass
            return status_of(s, timeout)
    except OSError:
        return None


class SlowClients:
    """n connections that each send one header byte a second, never finishing."""

    HEAD = b"GET /v2/health/ready HTTP/1.1\r\nHost: soak\r\nX-Slow: " + b"a" * 4096

    def __init__(self, host, port, n):
        self.host, self.port, self.n = host, port, n
        self.socks = []  # (socket, next byte index)
        self.reopened = 0

    def tick(self):
        alive = []
        for s, i in self.socks:
            try:
                s.send(self.HEAD[i:i + 1])
                alive.append((s, (i + 1) % len(self.HEAD)))
            except OSError:
                s.close()
                self.reopened += 1
        self.socks = alive
        while len(self.socks) < self.n:
            try:
                s = socket.create_connection((self.host, self.port), timeout=2)
                s.setblocking(False)
                self.socks.append((s, 0))
            except OSError:
                break

    def close(self):
        for s, _ in self.socks:
            s.close()


def nested_body(depth):
    return ('{"inputs":[{"name":"q","shape":[1],"datatype":"FP32","data":' + "[" * depth +
            "1" + "]" * depth + "}]}").encode()


def oversized_body(mib):
    values = ",".join(["1.5"] * (mib * 1024 * 1024 // 4))
    return ('{"inputs":[{"name":"q","shape":[1],"datatype":"FP32","data":[' + values +
            "]}]}").encode()


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    host, port, duration = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    slow = SlowClients(host, port, int(sys.argv[4]) if len(sys.argv) == 5 else 16)
    seen = collections.defaultdict(collections.Counter)
    failures = []
    nested = nested_body(100000)
    oversized = oversized_body(OVERSIZED_MIB)
    json_head = [("Content-Type", "application/json")]

    def expect_4xx(kind, status):
        seen[kind][status] += 1
        if status is None or not 400 <= status < 500:
            failures.append("%s answered %s, expected a 4xx" % (kind, status))

    end = time.monotonic() + duration
    turn = 0
    while time.monotonic() < end:
        tick_start = time.monotonic()
        slow.tick()
        t0 = time.monotonic()
        status = send(host, port, request_bytes("GET", "/v2/health/ready", []),
                      timeout=PROBE_TIMEOUT_S)
        took = time.monotonic() - t0
        seen["probe"][status] += 1
        if status != 200:
            failures.append("readiness probe answered %s after %.1f s beside %d slow clients"
                            % (status, took, len(slow.socks)))
        kind = turn % 4
        turn += 1
        if kind == 0:
            expect_4xx("announced_4gib", send(host, port, request_bytes(
                "POST", INFER, json_head + [("Content-Length", str(4 << 30))])))
        elif kind == 1:
            expect_4xx("nested", send(host, port, request_bytes(
                "POST", INFER, json_head + [("Content-Length", str(len(nested)))], nested)))
        elif kind == 2:
            head = request_bytes("POST", INFER,
                                 json_head + [("Content-Length", str(len(oversized)))])
            expect_4xx("oversized", send_large(host, port, head, len(oversized), oversized))
        else:
            body = b'{"inputs":[]}'
            status = send(host, port, request_bytes(
                "POST", INFER, json_head + [("Authorization", "Bearer junk"),
                                            ("Authorization", "Bearer junk-too"),
                                            ("Content-Length", str(len(body)))], body))
            seen["duplicate_auth"][status] += 1
            if status is None or status >= 500:
                failures.append("two Authorization headers answered %s" % status)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick_start)))
    slow.close()
    for kind in sorted(seen):
        print("soak_hostile: %-15s %s" % (kind, dict(sorted(seen[kind].items(),
                                                             key=lambda kv: str(kv[0])))))
    print("soak_hostile: %d slow clients held (%d reopened after the server closed them)"
          % (slow.n, slow.reopened))
    for f in failures[:20]:
        print("soak_hostile: FAILURE %s" % f)
    print("soak_hostile: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
