"""Request bodies: stalled and trickled (408), cut off (499, no traceback), too large, deep, odd, flooded.

Issue 8: items 1 (8 bytes of a declared 1,000 held the connection for ever), 6 (a client aborting mid-upload
was logged as a 500 with a ClientDisconnect traceback) and 2 (90,000 unknown keys stalled the event loop).
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import Server, wait_for

from hostile.client import answered_or_closed, assert_no_stall, connect, exchange, read_response, request_bytes
from hostile.conftest import BODY_TIMEOUT_S, assert_no_traceback, internal_errors, log_mark, requests_count

JSON = {"Content-Type": "application/json"}


def test_a_stalled_body_gets_408_in_the_error_shape(server: Server) -> None:
    mark = log_mark(server)

    def attack() -> None:
        before = requests_count(server, 408, "/predict")
        with connect(server.port) as sock:
            started = time.monotonic()
            sock.sendall(request_bytes("POST", "/predict", JSON, b'{"texts": ', content_length=1000))
            response = read_response(sock, BODY_TIMEOUT_S + 5)
            took = time.monotonic() - started
        assert response is not None
        response.assert_error(408, "body_timeout")
        assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 3
        # Counted and logged as the 408 it was (the app saw the client "go"; the protocol said why).
        wait_for(lambda: requests_count(server, 408, "/predict") == before + 1, 5, "the 408 counted")
        assert f"request_id={response.headers['x-request-id']}" in server.log()[mark:]

    assert_no_stall(server.port, attack)
    assert_no_traceback(server, mark)


def test_a_trickled_body_gets_408_at_the_body_deadline(server: Server) -> None:
    with connect(server.port) as sock:
        started = time.monotonic()
        sock.sendall(request_bytes("POST", "/predict", JSON, b"", content_length=1000))
        while not answered_or_closed(sock) and time.monotonic() - started < BODY_TIMEOUT_S + 5:
            try:
                sock.sendall(b" ")  # a byte every 100 ms: progress, but never the whole body
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
        response = read_response(sock, 5)
    assert response is not None
    response.assert_error(408, "body_timeout")
    assert time.monotonic() - started < BODY_TIMEOUT_S + 3


def test_a_client_aborting_mid_upload_is_a_499_without_a_traceback(server: Server) -> None:
    mark = log_mark(server)
    before_500 = internal_errors(server)

    def attack() -> None:
        before = requests_count(server, 499, "/predict")
        with connect(server.port) as sock:
            sock.sendall(request_bytes("POST", "/predict", JSON, b'{"texts": ["a', content_length=1000))
            time.sleep(0.2)  # the app is now reading the body
        wait_for(lambda: requests_count(server, 499, "/predict") == before + 1, 5, "the abort counted 499")

    assert_no_stall(server.port, attack)
    assert internal_errors(server) == before_500
    assert_no_traceback(server, mark)
    assert "POST /predict 499" in server.log()[mark:]


def test_a_chunked_body_over_the_limit_is_413(server: Server) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        try:
            for _ in range(40):  # 2.5 MB against the 1 MiB default
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = read_response(sock)
    assert response is not None
    response.assert_error(413)


def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(server: Server) -> None:
    response = exchange(server.port, request_bytes("POST", "/predict", JSON, b"", content_length=50_000_000))
    assert response is not None
    response.assert_error(413)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_json_is_refused_in_the_error_shape(server: Server, depth: int) -> None:
    body = b'{"texts": ' + b"[" * depth + b"]" * depth + b"}"

    def attack() -> None:
        response = exchange(server.port, request_bytes("POST", "/predict", JSON, body))
        assert response is not None
        assert response.status in (400, 422), response.body[:200]
        response.assert_error(response.status)

    assert_no_stall(server.port, attack)


def test_a_flood_of_unknown_keys_gets_422_without_stalling_the_server(server: Server) -> None:
    flood = {f"k{i:05d}": 1 for i in range(90_000)}
    body = json.dumps({"texts": ["hello"], **flood}, separators=(",", ":")).encode()
    assert len(body) < 1_048_576

    def attack() -> None:
        response = exchange(server.port, request_bytes("POST", "/predict", JSON, body))
        time.sleep(0.05)  # a probe sent at the very end of the request is answered too
        assert response is not None
        response.assert_error(422)

    assert_no_stall(server.port, attack)


@pytest.mark.parametrize(("name", "body"), [
    ("invalid UTF-8", b'{"texts": ["caf\xe9 \xff\xfe"]}'),
    ("UTF-16 with a BOM", '{"texts": ["hello"]}'.encode("utf-16")),
    ("UTF-8 with a BOM", b'\xef\xbb\xbf{"texts": ["hello"]}'),
    ("a lone surrogate escape", b'{"texts": ["\\ud800"]}'),
    ("NUL bytes", b'{"texts": ["a\x00b"]}\x00'),
])
def test_odd_body_encodings_get_a_4xx_in_the_error_shape(server: Server, name: str, body: bytes) -> None:
    def attack() -> None:
        response = exchange(server.port, request_bytes("POST", "/predict", JSON, body))
        assert response is not None, name
        assert 400 <= response.status < 500, (name, response.status, response.body[:200])
        response.assert_error(response.status)

    assert_no_stall(server.port, attack)


def test_a_latin1_body_declared_as_such_is_refused_400(server: Server) -> None:
    body = '{"texts": ["café"]}'.encode("latin-1")
    response = exchange(server.port, request_bytes(
        "POST", "/predict", {"Content-Type": "application/json; charset=iso-8859-1"}, body))
    assert response is not None
    response.assert_error(400, "invalid_json")
