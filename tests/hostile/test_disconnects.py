"""A client that goes away at each stage: during its head, during its body, while queued, while running.

Each is the client's doing: never a 500, never a traceback, the server answers /health/live throughout and
serves the next request. Requests the app had accepted are counted 499 (nginx's "client closed request").
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import httpx
from conftest import Server, metric_value, wait_for

from hostile.client import assert_no_stall, connect, request_bytes
from hostile.conftest import assert_no_traceback, internal_errors, log_mark, metrics_text, requests_count

JSON = {"Content-Type": "application/json"}


def gate_dir(server: Server) -> Path:
    return Path(server.env["FAKE_GATE_DIR"])


def in_flight(server: Server) -> float:
    return metric_value(metrics_text(server), "inferd_requests_in_flight")


def predict_ok(server: Server, text: str = "still serving") -> None:
    r = httpx.post(server.url + "/predict", json={"texts": [text]}, timeout=30)
    assert r.status_code == 200, r.text


def test_gone_during_the_head(server: Server) -> None:
    mark = log_mark(server)
    before = internal_errors(server)

    def attack() -> None:
        for cut in (5, 20, 40):
            with connect(server.port) as sock:
                sock.sendall(request_bytes("POST", "/predict", JSON, b'{"texts": ["x"]}')[:cut])
        time.sleep(0.2)

    assert_no_stall(server.port, attack)
    assert internal_errors(server) == before
    predict_ok(server)
    assert_no_traceback(server, mark)


def test_gone_during_the_body(server: Server) -> None:
    mark = log_mark(server)

    def attack() -> None:
        before = requests_count(server, 499, "/predict")
        with connect(server.port) as sock:
            sock.sendall(request_bytes("POST", "/predict", JSON, b'{"texts": ["hal', content_length=500))
            time.sleep(0.2)
        wait_for(lambda: requests_count(server, 499, "/predict") == before + 1, 5, "499 counted")

    assert_no_stall(server.port, attack)
    predict_ok(server)
    assert_no_traceback(server, mark)


def _hold_worker(server: Server, gate: str) -> tuple[threading.Thread, dict[str, int]]:
    """A request whose batch blocks the (only) worker until the gate file appears."""
    answer: dict[str, int] = {}

    def run() -> None:
        r = httpx.post(server.url + "/predict", json={"texts": [f"hold:{gate} x"]}, timeout=60)
        answer["status"] = r.status_code

    holder = threading.Thread(target=run)
    holder.start()
    wait_for(lambda: in_flight(server) >= 1, 10, "the held request running")
    return holder, answer


def test_gone_while_queued(server: Server) -> None:
    mark = log_mark(server)
    errors = internal_errors(server)
    gates = (f"queued-{n}" for n in itertools.count())

    def attack() -> None:
        before = requests_count(server, 499, "/predict")
        gate = next(gates)
        holder, held = _hold_worker(server, gate)
        try:
            with connect(server.port) as sock:
                sock.sendall(request_bytes("POST", "/predict", JSON, b'{"texts": ["waiting in the queue"]}'))
                wait_for(lambda: in_flight(server) >= 2, 10, "the second request queued")
            wait_for(lambda: requests_count(server, 499, "/predict") == before + 1, 10, "the queued one 499")
        finally:
            (gate_dir(server) / gate).touch()
            holder.join(60)
        assert held["status"] == 200

    assert_no_stall(server.port, attack)
    assert internal_errors(server) == errors
    predict_ok(server)
    assert_no_traceback(server, mark)


def test_gone_while_running(server: Server) -> None:
    mark = log_mark(server)
    errors = internal_errors(server)
    gates = (f"running-{n}" for n in itertools.count())

    def attack() -> None:
        before = requests_count(server, 499, "/predict")
        gate = next(gates)
        try:
            with connect(server.port) as sock:
                sock.sendall(request_bytes("POST", "/predict", JSON, b'{"texts": ["hold:%s x"]}' % gate.encode()))
                wait_for(lambda: in_flight(server) >= 1, 10, "the request running")
            wait_for(lambda: requests_count(server, 499, "/predict") == before + 1, 10, "the running one 499")
        finally:
            (gate_dir(server) / gate).touch()
        wait_for(lambda: in_flight(server) == 0, 10, "the worker free again")

    assert_no_stall(server.port, attack)
    assert internal_errors(server) == errors
    predict_ok(server)
    assert_no_traceback(server, mark)
