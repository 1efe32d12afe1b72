"""Raw-socket HTTP for the hostile-client suite, and the liveness probe that measures the server's stall.

A hostile client does what httpx will not (half a head, a body that stops, bytes a header must not hold),
so these tests speak HTTP/1.1 over plain sockets. ``LivenessProbe`` runs beside each attack: a process
asking ``GET /health/live`` on its own keep-alive connection every few milliseconds, recording how long each
answer took. The issue's property is that the server keeps answering it within 100 ms whatever one client
does; the probe's worst answer is that stall.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STALL_LIMIT_S = 0.1
ERROR_KEYS = {"message", "type", "code", "param"}


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def assert_error(self, status: int, code: str | None = None) -> dict[str, Any]:
        """The one error shape, JSON, with this status (and code); returns the error object."""
        assert self.status == status, (self.status, self.body[:300])
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        err = self.json()["error"]
        assert set(err) == ERROR_KEYS, err
        assert isinstance(err["message"], str) and err["message"]
        if code is not None:
            assert err["code"] == code, err
        assert self.headers.get("x-request-id"), self.headers
        return err


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request_bytes(method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"",
                  content_length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or content_length is not None:
        lines.append(f"Content-Length: {len(body) if content_length is None else content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def read_response(sock: socket.socket, timeout: float = 10.0) -> RawResponse | None:
    """One response off the socket; None if the server closed it without answering."""
    return _read_one(sock, bytearray(), time.monotonic() + timeout)


def read_responses(sock: socket.socket, count: int, timeout: float = 10.0) -> list[RawResponse | None]:
    """``count`` responses to pipelined requests, in order; None for each the server closed before.

    One recv may hold the end of one answer and the start of the next: what is past an answer is kept for
    the next one (``read_response`` drops it).
    """
    pending, deadline = bytearray(), time.monotonic() + timeout
    return [_read_one(sock, pending, deadline) for _ in range(count)]


def _read_one(sock: socket.socket, pending: bytearray, deadline: float) -> RawResponse | None:
    data = bytes(pending)
    while b"\r\n\r\n" not in data:
        chunk = _recv(sock, deadline)
        if not chunk:
            if data:
                raise AssertionError(f"connection closed inside a response head: {data[:200]!r}")
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = _recv(sock, deadline)
        if not chunk:
            break
        rest += chunk
    pending[:] = rest[length:]
    return RawResponse(int(status_line.split()[1]), headers, rest[:length])


def _recv(sock: socket.socket, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise AssertionError("no answer in time")
    sock.settimeout(remaining)
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""
    except TimeoutError:
        raise AssertionError("no answer in time") from None


def answered_or_closed(sock: socket.socket) -> bool:
    """Whether the server has written something or closed (without blocking)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server closes the connection (EOF or reset) within ``timeout``, having sent nothing."""
    deadline = time.monotonic() + timeout
    try:
        return _recv(sock, deadline) == b""
    except AssertionError:
        return False


def exchange(port: int, data: bytes, timeout: float = 10.0) -> RawResponse | None:
    with connect(port, timeout) as sock:
        sock.sendall(data)
        return read_response(sock, timeout)


PROBE = """
import json, os, socket, sys, time
port, every = int(sys.argv[1]), float(sys.argv[2])
try:
    os.setpriority(os.PRIO_PROCESS, 0, -10)  # a busy shared machine must not read as the server's stall
except OSError:
    pass
request = b"GET /health/live HTTP/1.1\\r\\nHost: probe\\r\\n\\r\\n"
latencies, failures, sock = [], [], None
os.set_blocking(0, False)
print("ready", flush=True)
while True:
    try:
        if os.read(0, 1) == b"":
            break  # stdin closed: stop
    except BlockingIOError:
        pass
    try:
        if sock is None:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        sock.sendall(request)
        data = b""
        while b"\\r\\n\\r\\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        head, _, body = data.partition(b"\\r\\n\\r\\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\\r\\n")[0])
        while len(body) < length:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed")
            body += chunk
        took = time.perf_counter() - started
        if not head.startswith(b"HTTP/1.1 200"):
            failures.append(head[:40].decode("latin-1"))
        else:
            latencies.append(took)
    except (OSError, ValueError, IndexError) as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        if sock is not None:
            sock.close()
        sock = None
    time.sleep(every)
print(json.dumps({"latencies": latencies, "failures": failures}), flush=True)
"""


@dataclass
class LivenessProbe:
    """``GET /health/live`` every ``every_s`` on one keep-alive connection, from a process of its own.

    A process, not a thread: the attack in the test's process must not hold the probe up (the GIL), and it
    asks for a higher scheduling priority (when allowed), so other work on a shared machine is not taken for
    the server's stall. The server's main thread (its event loop) is raised alike by the suite's fixture.
    """

    port: int
    every_s: float = 0.02
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __enter__(self) -> LivenessProbe:
        self._proc = subprocess.Popen([sys.executable, "-c", PROBE, str(self.port), str(self.every_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline().strip() == "ready"
        time.sleep(max(0.1, self.every_s * 4))  # a few answers before the attack
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        try:
            out = self._proc.stdout.read()
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            raise
        result = json.loads(out.strip().splitlines()[-1])
        self.latencies, self.failures = result["latencies"], result["failures"]

    @property
    def worst(self) -> float:
        return max(self.latencies, default=float("inf"))

    def check_answered(self) -> None:
        """Every probe during the attack was answered 200."""
        assert not self.failures, self.failures[:5]
        assert len(self.latencies) >= 3, f"only {len(self.latencies)} probes answered"


def assert_no_stall(port: int, attack: Callable[[], object], tries: int = 3, limit: float = STALL_LIMIT_S) -> None:
    """Run ``attack`` (which asserts its own outcome) beside a probe; every probe must be answered 200, and in
    at least one run none slower than ``limit``.

    A stall of the event loop happens on every run of the same attack; a scheduling hiccup of a shared
    machine does not, so the best of ``tries`` runs is the server's own figure (as tests/integration/
    test_bodies.py judges part B's pathological bodies).
    """
    worst = []
    for _ in range(tries):
        with LivenessProbe(port) as probe:
            attack()
        probe.check_answered()
        worst.append(probe.worst)
        if probe.worst <= limit:
            return
    raise AssertionError(f"/health/live stalled on every run: {[round(w * 1e3) for w in worst]} ms "
                         f"(limit {limit * 1e3:.0f} ms)")
