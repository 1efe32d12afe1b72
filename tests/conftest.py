"""Shared fixtures: tiny random BERT folders, and real ``inferd serve`` processes (tests/servers.py) per test or
per module."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from servers import ROOT, Server, free_port, running, start_server  # noqa: E402,F401 (re-exported to the suites)
from tinymodel import write_tiny_bert  # noqa: E402


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text exposition (0.0 when absent, as an unset counter)."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "condition", *,
             every: float = 0.02) -> object:
    """Poll until condition() is truthy and return its value; fail naming `what` after `timeout` seconds. The
    sync twin of tests/enginekit.py's ``until``. Every 20 ms by default: most callers read a server over HTTP, and
    a faster poll takes the CPU it needs; an in-process condition polls faster (``every=0.002``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what} not reached within {timeout}s")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_root: Path) -> Path:
    """A tiny random BERT with mean pooling and normalisation (version 'v1' in the tests)."""
    return write_tiny_bert(models_root / "tiny-v1", seed=1)


@pytest.fixture(scope="session")
def tiny_model_v2(models_root: Path) -> Path:
    """Same architecture, other weights: outputs distinguishable from tiny_model's."""
    return write_tiny_bert(models_root / "tiny-v2", seed=2)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Factory: ``serve(env={...})`` starts a server; every one started is stopped after the test."""
    started: list[Server] = []

    def _serve(env: dict[str, str] | None = None, **kw) -> Server:
        server = start_server(tmp_path, env, **kw)
        started.append(server)
        return server

    yield _serve
    for server in started:
        server.stop(signal.SIGTERM, timeout=15)


@pytest.fixture(scope="module")
def module_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """Factory for servers the whole module shares: ``module_serve(env, ...)`` takes start_server's arguments;
    every one started is stopped (SIGTERM, killed after ``stop_timeout`` seconds) when the module ends
    (``clean_exit=True``: and must exit with 0)."""
    started: list[tuple[Server, bool, float]] = []

    def _serve(env: dict[str, str] | None = None, *, clean_exit: bool = False, stop_timeout: float = 30.0,
               **kw) -> Server:
        server = start_server(tmp_path_factory.mktemp("srv"), env, **kw)
        started.append((server, clean_exit, stop_timeout))
        return server

    yield _serve
    codes = [(server, server.stop(signal.SIGTERM, timeout=wait), clean) for server, clean, wait in started]
    for server, code, clean in codes:
        assert not clean or code == 0, f"server exited with {code}:\n{server.log()[-4000:]}"


@pytest.fixture
def hub_client_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clients here talk to our server on 127.0.0.1, never to the Hub. huggingface_hub refuses every request,
    whatever its URL, in offline mode, which it reads once at import from HF_HUB_OFFLINE; an in-process app of an
    earlier test sets that variable in this process (create_app's own guard), so the suite passed alone and failed
    in the full run. A user's client with HF_HUB_OFFLINE=1 would meet the same refusal (docs/endpoints.md)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
