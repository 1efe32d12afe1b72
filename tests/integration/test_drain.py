"""Graceful shutdown with a real server process: SIGTERM/SIGINT drain accepted work, refuse new work, exit 0.

The model is ``lifecycle_fakes:SlowHandler``: every batch takes a known time, so requests are reliably in
flight (running or queued) when the signal arrives, and a "stall" text is a request that never finishes. Long
documents need a tokenizer to be split on: ``lifecycle_fakes:SlowEmbedding`` is a tiny BERT as slow.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from conftest import Server, metric_value, wait_for
from lifecycle_fakes import vector_for
from tinymodel import write_tiny_bert


def slow_server(serve: Callable[..., Server], tmp_path: Path, drain_timeout_s: float, **env: str) -> Server:
    """A server of the slow fake; the test signals it itself, and ``serve`` stops whatever a failure left running."""
    return serve({
        "INFERD__MODEL__TASK": "lifecycle_fakes:SlowHandler", "INFERD__MODEL__PATH": str(tmp_path),
        "INFERD__MODEL__VERSION": "slow-1",
        "INFERD__BATCHING__MAX_BATCH_SIZE": "1",  # one request per batch: the rest wait in the queue
        "INFERD__SERVER__DRAIN_TIMEOUT_S": str(drain_timeout_s), **env}, wait="/health/ready")


def in_flight(server: Server) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("inferd_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


def send_all(server: Server, texts: list[str], already: int = 0,
             ) -> tuple[list[threading.Thread], dict[str, httpx.Response]]:
    """Send each text in its own request, concurrently; return once all are accepted (in flight)."""
    answers: dict[str, httpx.Response] = {}

    def one(text: str) -> None:
        with server.client(timeout=60) as c:
            answers[text] = c.post("/predict", json={"texts": [text]})

    threads = [threading.Thread(target=one, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    total = already + len(texts)
    wait_for(lambda: in_flight(server) == total, 30, f"{total} requests in flight")
    return threads, answers


def exit_within(server: Server, seconds: float) -> int:
    try:
        return server.proc.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds}s after the signal:\n{server.log()[-3000:]}") from None


def test_sigterm_completes_accepted_work_refuses_new_and_exits_0(tmp_path: Path, serve: Callable[..., Server]) -> None:
    drain_timeout = 20.0
    server = slow_server(serve, tmp_path, drain_timeout, LIFECYCLE_DELAY_S="0.4")
    texts = [f"accepted {i}" for i in range(6)]  # ~2.4 s of work: one running, five queued
    threads, answers = send_all(server, texts)
    server.proc.send_signal(signal.SIGTERM)

    with server.client() as c:
        ready = wait_for(lambda: (r := c.get("/health/ready")).status_code == 503 and r, 5, "draining")
        assert ready.json() == {"status": "draining"} and ready.headers["Retry-After"]
        assert c.get("/health/live").status_code == 200  # draining is not dead: no restart
        refused = c.post("/predict", json={"texts": ["too late"]})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "draining"
        assert in_flight(server) > 0  # the refusal came while accepted work was still running

    for t in threads:
        t.join(60)
    assert {text: r.status_code for text, r in answers.items()} == dict.fromkeys(texts, 200)
    for text, r in answers.items():
        assert r.json()["results"] == [vector_for(text)]
    assert exit_within(server, drain_timeout) == 0
    assert "drained" in server.log()


def test_a_request_stuck_at_the_drain_timeout_gets_503_and_the_process_still_exits_0(
        tmp_path: Path, serve: Callable[..., Server]) -> None:
    drain_timeout = 2.0
    server = slow_server(serve, tmp_path, drain_timeout, LIFECYCLE_STALL_S="120")
    # One running forever, then one queued behind it: neither can finish within the drain timeout.
    threads, answers = send_all(server, ["stall forever"])
    more, queued = send_all(server, ["queued behind it"], already=1)
    threads += more
    answers.update(queued)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(60)
    answered_after = time.monotonic() - signalled
    for r in answers.values():
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert r.json()["error"]["code"] == "draining"
    # Answered when the drain gave up, not before (nothing was dropped early) and not left hanging.
    assert answered_after >= drain_timeout
    # The stuck worker thread must not hold the exit up: the drain's timeout plus shutdown bookkeeping.
    assert exit_within(server, drain_timeout + 5) == 0
    assert "drain timed out" in server.log()


def test_shutdown_with_a_stuck_request_and_a_stalled_upload_fits_the_drain_timeout_plus_the_margin(
        tmp_path: Path, serve: Callable[..., Server]) -> None:
    """Issue 8, item 5: on main uvicorn's graceful timeout ran after the drain (2 x drain + 5 s in all), and a
    client stalled mid-upload then got a text/plain 500 and left a traceback."""
    from inferd.server import SHUTDOWN_MARGIN_S

    drain_timeout = 3.0
    server = slow_server(serve, tmp_path, drain_timeout, LIFECYCLE_STALL_S="120")
    threads, answers = send_all(server, ["stall forever"])  # the drain runs its full timeout
    upload = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    upload.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 1000\r\n\r\n" + b'{"texts":')  # ... and then nothing more
    time.sleep(0.3)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert exit_within(server, drain_timeout + SHUTDOWN_MARGIN_S + 2) == 0
    took = time.monotonic() - signalled
    assert took <= drain_timeout + SHUTDOWN_MARGIN_S, f"shutdown took {took:.1f} s"

    stalled = upload.recv(65536)
    upload.close()
    head, _, body = stalled.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), stalled[:300]
    assert b"content-type: application/json" in head.lower() and b"retry-after: 1" in head.lower()
    assert json.loads(body)["error"]["code"] == "draining"
    for t in threads:
        t.join(30)
    assert answers["stall forever"].status_code == 503
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert "POST /predict 503" in log  # the stalled upload logged as what it got


def test_a_long_document_accepted_before_sigterm_runs_all_its_waves_through_the_drain(
        tmp_path: Path, serve: Callable[..., Server]) -> None:
    """A document's pieces run in waves; only a wave's pieces were counted as accepted work, so at SIGTERM the next
    wave was refused and the whole document answered 503 (its computed pieces thrown away) with drain time to
    spare, and the drain could end between two waves."""
    server = serve({"INFERD__MODEL__TASK": "lifecycle_fakes:SlowEmbedding",
                    "INFERD__MODEL__PATH": str(write_tiny_bert(tmp_path / "bert", seed=1)),
                    "INFERD__MODEL__LOAD_MODE": "eager", "INFERD__BATCHING__MAX_BATCH_SIZE": "2",
                    "INFERD__SERVER__DRAIN_TIMEOUT_S": "20", "LIFECYCLE_DELAY_S": "0.1"}, wait="/health/ready",
                   timeout=120)
    doc = " ".join(f"word{i} alpha beta gamma." for i in range(60))  # 30 pieces of 32 tokens: 15 waves of 2
    body = {"input": [doc], "chunking": {"mode": "pooled", "max_tokens": 32}}
    answers: list[httpx.Response] = []

    def post() -> None:
        with server.client(timeout=60) as c:
            answers.append(c.post("/v1/embeddings", json=body))

    sender = threading.Thread(target=post)
    sender.start()
    wait_for(lambda: metric_value(httpx.get(server.url + "/metrics", timeout=10).text, "inferd_batch_size_count") >= 2,
             30, "the document's first waves ran")
    server.proc.send_signal(signal.SIGTERM)
    with server.client() as c:
        wait_for(lambda: c.get("/health/ready").status_code == 503, 5, "draining")
        late = c.post("/v1/embeddings", json=body)  # a document sent after the signal is refused at once
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    sender.join(60)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    assert len(answers[0].json()["data"][0]["embedding"]) > 0
    assert exit_within(server, 20) == 0
