"""Control characters in every header and in the path, bytes outside ASCII, and log injection (item 4).

A raw control character anywhere in the head is refused by the parser (400, the one error shape); a
percent-encoded one reaches the app (404 for an unknown path) and its log line, where it must be escaped:
on main ``/x%0A2026-12-01 ... CRITICAL inferd.security: admin login ok`` wrote a forged line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import Server, wait_for

from hostile.client import assert_no_stall, exchange
from hostile.conftest import assert_no_traceback, internal_errors, log_mark

FORGED = "2026-12-01 00:00:00,000 CRITICAL inferd.security: admin login ok"
# Every C0 control but TAB (which RFC 9110 allows inside a field value), and DEL.
CONTROLS = [c for c in range(0x20) if c != 0x09] + [0x7F]
# Percent-encoded, these reach the app and its logs: LF, CR, CRLF, NUL, ESC, NEL, U+2028, and RLO.
ENCODED = ["%0A", "%0D", "%0D%0A", "%00", "%1B[2J", "%C2%85", "%E2%80%A8", "%E2%80%AE"]


def head(path: bytes = b"/health/live", extra: bytes = b"") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"Connection: close\r\n\r\n"


@pytest.mark.parametrize("where", ["header value", "header name", "path"])
def test_a_raw_control_character_anywhere_in_the_head_is_400(server: Server, where: str) -> None:
    def attack() -> None:
        for code in CONTROLS:
            c = bytes([code])
            data = {"header value": head(extra=b"X-Test: a" + c + b"b\r\n"),
                    "header name": head(extra=b"X-T" + c + b"est: ab\r\n"),
                    "path": head(path=b"/health/li" + c + b"ve")}[where]
            response = exchange(server.port, data)
            assert response is not None, hex(code)
            assert response.status == 400, (hex(code), response.status)
            response.assert_error(400, "invalid_http")

    assert_no_stall(server.port, attack)
    assert internal_errors(server) == 0


def test_tab_and_bytes_above_ascii_in_a_header_value_are_accepted(server: Server) -> None:
    # obs-text (latin-1 bytes, or UTF-8 read as them) is legal in a field value; it must not break anything.
    for value in (b"a\tb", b"caf\xe9", "日本".encode(), b"\xff\xfe\x80"):
        response = exchange(server.port, head(extra=b"X-Test: " + value + b"\r\n"))
        assert response is not None and response.status == 200, value


@pytest.mark.parametrize("value", [b"caf\xe9", b"rid\x80x", b"a" * 200, b"a b", b"<script>"])
def test_an_unsafe_request_id_is_replaced_not_echoed(server: Server, value: bytes) -> None:
    response = exchange(server.port, head(extra=b"X-Request-ID: " + value + b"\r\n"))
    assert response is not None and response.status == 200
    rid = response.headers["x-request-id"]
    assert rid.encode("latin-1") != value and len(rid) == 32 and rid.isalnum()


def test_non_ascii_bytes_in_the_path_are_400_and_percent_encoded_ones_404(server: Server) -> None:
    raw = exchange(server.port, head(path=b"/caf\xc3\xa9"))
    assert raw is not None
    raw.assert_error(400, "invalid_http")
    encoded = exchange(server.port, head(path=b"/caf%C3%A9%FF"))
    assert encoded is not None
    encoded.assert_error(404)


def _forged_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(FORGED) or line.startswith("2026-12-01 00:00")]


def test_encoded_control_characters_in_the_path_cannot_forge_a_text_log_line(server: Server) -> None:
    def attack() -> None:
        for enc in ENCODED:
            response = exchange(server.port, head(path=f"/x{enc}{FORGED.replace(' ', '%20')}".encode()))
            assert response is not None
            response.assert_error(404)

    assert_no_stall(server.port, attack)
    wait_for(lambda: server.log().count("admin login ok") >= len(ENCODED), 5, "the access lines")
    log = server.log()
    assert _forged_lines(log) == []
    assert "/x\\x0a2026-12-01" in log  # escaped, not dropped: the operator still sees what was sent
    assert "\u2028" not in log and "\x85" not in log and "\x1b" not in log and "\u202e" not in log


def test_encoded_control_characters_cannot_forge_a_json_log_line(module_server: Callable[..., Server]) -> None:
    jsonlog = module_server(INFERD__SERVER__LOG_FORMAT="json")
    for enc in ENCODED:
        response = exchange(jsonlog.port, head(path=f"/x{enc}{FORGED.replace(' ', '%20')}".encode()))
        assert response is not None
        response.assert_error(404)
    wait_for(lambda: jsonlog.log().count("admin login ok") >= len(ENCODED), 5, "the access lines")
    lines = [line for line in jsonlog.log().splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]  # every line is one whole JSON object
    access = [r for r in records if r.get("logger") == "inferd.access" and "admin login ok" in r["message"]]
    assert len(access) == len(ENCODED)
    for r in access:
        assert not any(0x7F <= ord(c) <= 0x9F or ord(c) < 0x20 or c in "\u2028\u2029\u202e" for c in r["message"])
    assert not any(r.get("logger") == "inferd.security" for r in records)


def test_control_characters_in_json_values_reach_no_log_line_raw(server: Server) -> None:
    mark = log_mark(server)
    # JSON escapes decode to real control characters: a model name, a routing key, the texts.
    nasty = f"m\n{FORGED}\u2028\x1b[31m"
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r1 = c.post("/v1/embeddings", json={"input": ["hello"], "model": nasty})
        r2 = c.post("/predict", json={"texts": ["hello"]}, headers={"X-Routing-Key": "k\u00e9".encode("latin-1")})
        r3 = c.post("/predict", json={"texts": [nasty], "unknown\nkey": 1})
    for r in (r1, r2, r3):
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "code", "param"}
    time.sleep(0.2)
    log = server.log()
    assert _forged_lines(log) == []
    assert "\u2028" not in log and "\x1b" not in log
    assert_no_traceback(server, mark)
