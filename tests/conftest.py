"""Shared fixtures: tiny random BERT folders, and real uvicorn server processes on free 127.0.0.1 ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from tinymodel import write_tiny_bert  # noqa: E402


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text exposition (0.0 when absent, as an unset counter)."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    """Poll until condition() is truthy and return its value; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A real ``inferd serve`` process; ``url`` is its base URL; output goes to ``log_path``."""

    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path
    admin_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 30.0), **kw)

    def wait_ready(self, timeout: float = 60.0, path: str = "/health/ready") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(tmp_path: Path, env: dict[str, str] | None = None, args: list[str] | None = None,
                 wait: str | None = "/health/live", timeout: float = 60.0) -> Server:
    """Start ``python -m inferd.cli serve`` with INFERD__ environment overrides; waits for `wait` to be 200."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("INFERD")}
    full_env.update({
        "INFERD_ENV": "dev",
        "INFERD_CONFIG_DIR": str(ROOT / "configs"),
        "INFERD__SERVER__PORT": str(port),
        "INFERD__SERVER__HOST": "127.0.0.1",
        "INFERD__SERVER__LOG_LEVEL": "INFO",
        "INFERD__RUNTIME__TORCH_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), full_env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    full_env.update(env or {})
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "inferd.cli", "serve", *(args or [])], env=full_env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    admin_port = full_env.get("INFERD__SERVER__ADMIN_PORT")
    server = Server(proc, f"http://127.0.0.1:{port}", port, log_path,
                    f"http://127.0.0.1:{admin_port}" if admin_port else None, full_env)
    if wait:
        try:
            server.wait_ready(timeout, wait)
        except BaseException:
            server.stop(signal.SIGKILL)
            raise
    return server


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


@pytest.fixture
def hub_client_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clients here talk to our server on 127.0.0.1, never to the Hub. huggingface_hub refuses every request,
    whatever its URL, in offline mode, which it reads once at import from HF_HUB_OFFLINE; an in-process app of an
    earlier test sets that variable in this process (create_app's own guard), so the suite passed alone and failed
    in the full run. A user's client with HF_HUB_OFFLINE=1 would meet the same refusal (README, Endpoints)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
