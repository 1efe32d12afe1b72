"""Request heads: too large (431), too slow (408), idle (closed), invalid (400, 505), too many connections (503).

Issue 8, item 1: on main a 300 MB header line was buffered whole (RSS 415 -> 963 MB), an 8 MB header got
200, and half a head held its connection for ever.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
from conftest import Server

from hostile.client import (
    answered_or_closed,
    assert_no_stall,
    closed_by_server,
    connect,
    exchange,
    read_response,
    request_bytes,
)
from hostile.conftest import HEADER_TIMEOUT_S, assert_no_traceback, internal_errors, requests_count

MAX_HEADER_BYTES = 16_384  # the default, which these servers keep


def test_a_huge_header_line_is_refused_431_while_it_streams_and_memory_stays_flat(server: Server) -> None:
    rss = psutil.Process(server.proc.pid)

    def attack() -> None:
        before = rss.memory_info().rss
        chunk = b"a" * 65536
        sent = 0
        with connect(server.port) as sock:
            sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Huge: ")
            try:
                # Up to 64 MB, stopping once the server answers: main kept reading (and buffering) it all.
                while sent < 64 * 2**20 and not answered_or_closed(sock):
                    sock.sendall(chunk)
                    sent += len(chunk)
                sock.sendall(b"\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed while we were still sending: the answer is already on its way
            response = read_response(sock)
        grown = rss.memory_info().rss - before
        assert response is not None
        response.assert_error(431, "header_too_large")
        assert response.headers["connection"] == "close"
        assert sent < 8 * 2**20, f"the server read {sent} bytes of head before refusing"
        assert grown < 16 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB for one header"

    assert_no_stall(server.port, attack)


def test_many_small_headers_past_the_cap_are_431(server: Server) -> None:
    headers = {f"X-H{i}": "v" * 20 for i in range(1000)}  # about 30 KB in all

    def attack() -> None:
        response = exchange(server.port, request_bytes("GET", "/health/live", headers))
        assert response is not None
        response.assert_error(431, "header_too_large")

    assert_no_stall(server.port, attack)


def test_a_long_url_past_the_cap_is_431(server: Server) -> None:
    response = exchange(server.port, request_bytes("GET", "/health/live?q=" + "x" * 20_000))
    assert response is not None
    response.assert_error(431, "header_too_large")


def test_a_head_under_the_cap_is_served(server: Server) -> None:
    response = exchange(server.port, request_bytes("GET", "/health/live", {"X-Big": "b" * 12_000}))
    assert response is not None and response.status == 200


def test_431_is_counted_and_logged_like_any_request(server: Server) -> None:
    before = requests_count(server, 431, "other")
    exchange(server.port, request_bytes("GET", "/x", {"X-Big": "b" * 20_000}))
    assert requests_count(server, 431, "other") == before + 1
    assert "refused 431 header_too_large" in server.log()


def test_a_slow_head_gets_408_at_the_header_timeout(server: Server) -> None:
    def attack() -> None:
        with connect(server.port) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            # Slowloris: a byte every 200 ms keeps the head "in progress" for ever unless its time is bounded.
            while not answered_or_closed(sock) and time.monotonic() - started < HEADER_TIMEOUT_S + 5:
                sock.sendall(b"a")
                time.sleep(0.2)
            response = read_response(sock)
            took = time.monotonic() - started
            assert response is not None
            response.assert_error(408, "header_timeout")
            assert closed_by_server(sock, 5)
        assert HEADER_TIMEOUT_S <= took < HEADER_TIMEOUT_S + 3

    assert_no_stall(server.port, attack)


def test_half_a_head_then_silence_gets_408(server: Server) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        response = read_response(sock, HEADER_TIMEOUT_S + 5)
        assert response is not None
        response.assert_error(408, "header_timeout")
        assert closed_by_server(sock, 5)


def test_a_connection_that_never_sends_is_closed_without_an_answer(server: Server) -> None:
    with connect(server.port) as sock:
        started = time.monotonic()
        assert closed_by_server(sock, HEADER_TIMEOUT_S + 5)
        assert time.monotonic() - started >= HEADER_TIMEOUT_S * 0.9


def test_a_kept_alive_connection_that_stalls_in_its_next_head_gets_408(server: Server) -> None:
    with connect(server.port) as sock:
        sock.sendall(request_bytes("GET", "/health/live"))
        first = read_response(sock)
        assert first is not None and first.status == 200
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHo")
        response = read_response(sock, HEADER_TIMEOUT_S + 5)
        assert response is not None
        response.assert_error(408, "header_timeout")


def test_invalid_http_gets_400_in_the_error_shape(server: Server) -> None:
    for garbage in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /health/live HTTP/1.1\r\nBad Header\r\n\r\n",
                    b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n12345",
                    b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        response = exchange(server.port, garbage)
        assert response is not None, garbage
        response.assert_error(400, "invalid_http")


def test_host_and_version_are_checked_before_the_app(server: Server) -> None:
    """Issue 30, item 5: main served all of these (RFC 9112 §3.2 says 400; HTTP/2.0 was answered as 1.1)."""
    before = {status: requests_count(server, status, "other") for status in (400, 505)}
    for head, status, code in (
            (b"GET /health/live HTTP/1.1\r\n\r\n", 400, "invalid_host"),
            (b"GET /health/live HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "invalid_host"),
            (b"GET /health/live HTTP/1.0\r\nHost: a\r\nhost: a\r\n\r\n", 400, "invalid_host"),
            (b"GET /health/live HTTP/1.1\r\nHost: a b/c\r\n\r\n", 400, "invalid_host"),
            (b"GET /health/live HTTP/2.0\r\nHost: a\r\n\r\n", 505, "http_version_not_supported")):
        response = exchange(server.port, head)
        assert response is not None, head
        response.assert_error(status, code)
        assert response.headers["connection"] == "close"
    assert requests_count(server, 400, "other") == before[400] + 4
    assert requests_count(server, 505, "other") == before[505] + 1
    assert "refused 505 http_version_not_supported" in server.log()
    # HTTP/1.0 may leave Host out; an IPv6 literal, a port and an empty value are hosts.
    for head in (b"GET /health/live HTTP/1.0\r\n\r\n", b"GET /health/live HTTP/1.1\r\nHost: [::1]:80\r\n\r\n",
                 b"GET /health/live HTTP/1.1\r\nHost: my_host.example:8000 \t\r\n\r\n",
                 b"GET /health/live HTTP/1.1\r\nHost:\r\n\r\n"):
        response = exchange(server.port, head)
        assert response is not None and response.status == 200, head


def test_connections_beyond_limit_concurrency_get_503_in_the_error_shape(
        module_server: Callable[..., Server]) -> None:
    limited = module_server(INFERD__SERVER__LIMIT_CONCURRENCY="4", INFERD__SERVER__HEADER_TIMEOUT_S="30")
    holders = [connect(limited.port) for _ in range(5)]  # open and idle: each counts as a connection
    try:
        time.sleep(0.2)

        def attack() -> None:  # the probe's own connection is over the limit too: liveness is exempt
            response = exchange(limited.port, request_bytes("GET", "/health/ready"))
            assert response is not None
            response.assert_error(503, "overloaded")
            assert response.headers["retry-after"] == "1"

        assert_no_stall(limited.port, attack)
    finally:
        for sock in holders:
            sock.close()
    time.sleep(0.3)
    response = exchange(limited.port, request_bytes("GET", "/health/ready"))
    assert response is not None and response.status == 200
    assert requests_count(limited, 503, "/health/ready") >= 1  # counted like any answer
    assert internal_errors(limited) == 0
    assert_no_traceback(limited)
