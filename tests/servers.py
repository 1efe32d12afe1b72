"""Real ``inferd serve`` processes on free 127.0.0.1 ports: the one way every suite starts, shares and stops them.

``start_server`` starts one; ``running`` starts one for a ``with`` block (a module-scoped fixture's body) and
stops it however the block ends; conftest's ``serve`` (per test) and ``module_serve`` (per module) fixtures are
built on them. A test that does not change its server shares the module's; one that does starts its own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


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


@contextmanager
def running(tmp_path: Path, env: dict[str, str] | None = None, *, clean_exit: bool = False,
            **kw: object) -> Iterator[Server]:
    """A server for the ``with`` block, stopped (SIGTERM) however it ends; ``clean_exit``: its exit code must be 0."""
    server = start_server(tmp_path, env, **kw)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        code = server.stop()
    assert not clean_exit or code == 0, f"server exited with {code}:\n{server.log()[-4000:]}"
