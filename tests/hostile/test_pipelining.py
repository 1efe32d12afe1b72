"""Pipelining: a request the protocol refuses waits behind the requests sent before it on its connection.

Issue 30, item 1: on main a refused request pipelined behind a good one was answered (and the write side
closed) while the good one was still in flight, so a client read the 400 as the first request's answer and
the first request, computed all the same, was logged 499 with ``Cannot call write() after write_eof()``.
A pipelined body's 408 did the same: its time ran while it waited behind the running request.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
from conftest import Server, metric_value, wait_for

from hostile.client import (
    answered_or_closed,
    closed_by_server,
    connect,
    read_response,
    read_responses,
    request_bytes,
)
from hostile.conftest import (
    BODY_TIMEOUT_S,
    assert_no_traceback,
    internal_errors,
    log_mark,
    metrics_text,
    requests_count,
)

GATES = (f"pipelined-{n}" for n in itertools.count())
JSON = {"Content-Type": "application/json"}

BAD = {
    "control character in the target": (b"GET /health/live\x01x HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_http"),
    "a head past max_header_bytes": (request_bytes("GET", "/health/live", {"X-Big": "b" * 17_000}),
                                     431, "header_too_large"),
    # Its head was parsed (a cycle queued behind the first), its body is not valid chunked encoding.
    "a bad body": (b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                   400, "invalid_http"),
    "no Host header": (b"GET /health/live HTTP/1.1\r\n\r\n", 400, "invalid_host"),
}


@pytest.mark.parametrize("bad", BAD, ids=list(BAD))
def test_a_refused_request_is_answered_after_the_one_before_it(server: Server, bad: str) -> None:
    data, status, code = BAD[bad]
    mark = log_mark(server)
    errors, closed = internal_errors(server), requests_count(server, 499, "/predict")
    gate = next(GATES)
    body = json.dumps({"texts": [f"hold:{gate} first"]}).encode()
    gate_file = Path(server.env["FAKE_GATE_DIR"]) / gate
    try:
        with connect(server.port) as sock:
            # One write: the refusal is decided while the first request has not even started.
            sock.sendall(request_bytes("POST", "/predict", JSON, body) + data)
            wait_for(lambda: in_flight(server) >= 1, 10, "the first request running")
            assert not answered_or_closed(sock), "answered while the first request is still running"
            gate_file.touch()
            first, second = read_responses(sock, 2)
            assert first is not None and first.status == 200, first
            assert first.json()["results"], first.body[:200]
            assert first.headers.get("connection") != "close"
            assert second is not None, "the refusal never came"
            second.assert_error(status, code)
            assert second.headers["connection"] == "close"
            assert closed_by_server(sock, 5)
    finally:
        gate_file.touch()  # a failed test must not leave the module's only worker held
    assert requests_count(server, 499, "/predict") == closed
    assert internal_errors(server) == errors
    log = server.log()[mark:]
    assert "write_eof" not in log and "without completing response" not in log, log[-2000:]
    assert_no_traceback(server, mark)


def test_every_request_before_the_refused_one_is_answered_in_order(server: Server) -> None:
    """Two good requests queued (one running, one waiting in uvicorn's pipeline), then a bad one."""
    with connect(server.port) as sock:
        sock.sendall(request_bytes("GET", "/health/live") + request_bytes("GET", "/health/ready")
                     + b"GET /\x7f HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = read_responses(sock, 3)
        assert closed_by_server(sock, 5)
    assert [a.status if a else None for a in answers] == [200, 200, 400]
    assert answers[1] is not None and answers[1].json()["status"] == "ready"


def test_a_pipelined_body_is_timed_from_when_its_request_runs(server: Server) -> None:
    """Queued behind a running request, a body is not read on: main's 408 came before the first answer."""
    gate = next(GATES)
    body = b'{"texts": ["second"]}'
    gate_file = Path(server.env["FAKE_GATE_DIR"]) / gate
    try:
        with connect(server.port) as sock:
            sock.sendall(request_bytes("POST", "/predict", JSON, json.dumps({"texts": [f"hold:{gate} x"]}).encode())
                         + request_bytes("POST", "/predict", JSON, body[:5], content_length=len(body)))
            wait_for(lambda: in_flight(server) >= 1, 10, "the first request running")
            time.sleep(BODY_TIMEOUT_S + 0.5)  # past the body timeout, counted from the second head
            assert not answered_or_closed(sock), "answered while the first request is still running"
            gate_file.touch()
            first = read_response(sock)
            assert first is not None and first.status == 200, first
            sock.sendall(body[5:])
            second = read_response(sock)
            assert second is not None and second.status == 200, second
    finally:
        gate_file.touch()


def in_flight(server: Server) -> float:
    return metric_value(metrics_text(server), "inferd_requests_in_flight")
