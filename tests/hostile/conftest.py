"""The hostile-client suite's servers: real ``inferd serve`` processes with the fake task, short timeouts.

One server per test module (starting one costs seconds); each test counts what it caused from metric
deltas and its own request ids, so tests in a module do not depend on each other's order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import Server, metric_value

# Short enough that a test waits little, long enough that a loaded 2-core machine never trips them by accident.
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5


def hostile_env(tmp: Path, **extra: str) -> dict[str, str]:
    gates = tmp / "gates"
    gates.mkdir(exist_ok=True)
    return {
        "INFERD__MODEL__TASK": "fakes:HashHandler", "INFERD__MODEL__PATH": str(tmp),
        "INFERD__SERVER__HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "INFERD__SERVER__BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "INFERD__SERVER__DRAIN_TIMEOUT_S": "2",
        "INFERD__BATCHING__MAX_BATCH_SIZE": "1",  # a held batch holds one request; the next ones queue
        "FAKE_GATE_DIR": str(gates), **extra}


@pytest.fixture(scope="module")
def module_server(module_serve: Callable[..., Server],
                  tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Server]:
    """Factory for servers that live for the whole module (conftest's module_serve: stopped at its end, even on
    failure), each run at a raised priority."""

    def _start(**extra: str) -> Server:
        tmp = tmp_path_factory.mktemp("hostile")
        server = module_serve(hostile_env(tmp, **extra), wait="/health/ready", stop_timeout=15)
        with contextlib.suppress(OSError):
            # Its main thread runs the event loop: raised like the probe's, so that a busy shared machine is
            # not read as a stall (the property under test is the server's own, not the scheduler's).
            os.setpriority(os.PRIO_PROCESS, server.proc.pid, -10)
        return server

    return _start


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Server]) -> Server:
    return module_server()


def metrics_text(server: Server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def requests_count(server: Server, status: int, endpoint: str | None = None) -> float:
    text = metrics_text(server)
    if endpoint is not None:
        return metric_value(text, "inferd_requests_total", endpoint=endpoint, status=str(status))
    return sum(metric_value(text, "inferd_requests_total", endpoint=e, status=str(status))
               for e in ("/predict", "/v1/embeddings", "/health/live", "/health/ready", "other"))


def internal_errors(server: Server) -> float:
    """Every 500 the server counted, whatever the endpoint: a hostile client must never cause one."""
    total = 0.0
    for line in metrics_text(server).splitlines():
        if line.startswith("inferd_requests_total{") and 'status="500"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def log_mark(server: Server) -> int:
    """Where the server's log ends now: a test checks only what it caused (the server is the module's)."""
    return len(server.log())


def assert_no_traceback(server: Server, since: int = 0) -> None:
    log = server.log()[since:]
    assert "Traceback" not in log and "unhandled error" not in log and "Exception in ASGI" not in log, log[-3000:]
