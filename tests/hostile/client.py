"""Raw-socket HTTP for the hostile-client suite, and the liveness probe that measures the server's stall.

A hostile client does what httpx will not (half a head, a body that stops, bytes a header must not hold),
so these tests speak HTTP/1.1 over plain sockets. ``LivenessProbe`` runs beside each attack: a thread
asking ``GET /health/live`` on its own keep-alive connection every few milliseconds, recording how long each
answer took. The issue's property is that the server keeps answering it within 100 ms whatever one client
does; the probe's worst answer is that stall.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
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
    deadline = time.monotonic() + timeout
    data = b""
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


@dataclass
class LivenessProbe:
    """``GET /health/live`` every ``every_s`` on one keep-alive connection, from its own thread."""

    port: int
    every_s: float = 0.02
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-probe", daemon=True)

    def __enter__(self) -> LivenessProbe:
        self._thread.start()
        deadline = time.monotonic() + 10
        while len(self.latencies) < 3 and not self.failures and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        sock: socket.socket | None = None
        request = request_bytes("GET", "/health/live")
        while not self._stop.is_set():
            try:
                if sock is None:
                    sock = connect(self.port)  # (re)connecting is not timed: only the answer is
                started = time.perf_counter()
                sock.sendall(request)
                response = read_response(sock, 10)
                took = time.perf_counter() - started
                if response is None or response.status != 200:
                    self.failures.append(f"answer {response.status if response else 'closed'}")
                    sock.close()
                    sock = None
                else:
                    self.latencies.append(took)
            except (OSError, AssertionError) as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
                if sock is not None:
                    sock.close()
                sock = None
            self._stop.wait(self.every_s)
        if sock is not None:
            sock.close()

    @property
    def worst(self) -> float:
        return max(self.latencies, default=float("inf"))

    def check(self, limit: float = STALL_LIMIT_S) -> None:
        """Every probe during the attack was answered 200, none slower than ``limit``."""
        assert not self.failures, self.failures[:5]
        assert len(self.latencies) >= 3, f"only {len(self.latencies)} probes answered"
        assert self.worst <= limit, (f"/health/live stalled {self.worst * 1e3:.0f} ms (limit "
                                     f"{limit * 1e3:.0f} ms) over {len(self.latencies)} probes")
