"""Starting the servers under test as real processes (uvicorn), and stopping them whatever happens."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerFailed(RuntimeError):
    """A server under test exited or never became ready; the message carries its log's tail."""


@dataclass
class ServerProc:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def wait_ready(self, path: str, timeout: float) -> float:
        """Poll ``path`` until it answers 200; return the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise ServerFailed(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each of a process's threads, summed by the OS's thread name (the numbers a name
    ends in dropped; Python's threads and torch's pool are all "python" there), the main thread (the event loop) apart:
    where a condition's cores go."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else re.sub(r"[-_:]?\d+$", "", (task / "comm").read_text().strip())
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _base_env(torch_threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERD")}
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return env


def _spawn(name: str, cmd: list[str], env: dict[str, str], port: int, log_dir: Path,
           cwd: Path | None = None) -> ServerProc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd or log_dir,
                                start_new_session=True)
    return ServerProc(name, proc, f"http://127.0.0.1:{port}", log_path)


def inferd_env(model_path: Path | None, torch_threads: int | None, extra_env: dict[str, str],
               config_dir: Path | None = None, tree: Path | None = None) -> dict[str, str]:
    """The environment of an inferd process under measurement: the prod overlay, quiet logs, the model, this
    checkout's configs (``tree``: another's, and its code), then ``extra_env``."""
    env = _base_env(torch_threads)
    env.update({"INFERD_ENV": "prod", "INFERD__SERVER__LOG_LEVEL": "WARNING",
                # prod.yaml's backend auto would judge and switch runtimes in the middle of a measurement: each
                # phase names its runtime (extra_env), torch unless it does; bench/auto_start.py measures auto.
                "INFERD__MODEL__BACKEND": "torch"})
    if tree is not None:
        env["PYTHONPATH"] = str(tree / "src")
    cfg = config_dir or ((tree or ROOT) / "configs")
    if (cfg / "base.yaml").is_file():
        env["INFERD_CONFIG_DIR"] = str(cfg)
    if model_path is not None:
        env["INFERD__MODEL__PATH"] = str(model_path)
    if torch_threads:
        env["INFERD__RUNTIME__TORCH_THREADS"] = str(torch_threads)
    env.update(extra_env)
    return env


def start_inferd(log_dir: Path, model_path: Path | None, torch_threads: int | None,
                 extra_env: dict[str, str], config_dir: Path | None = None,
                 timeout: float = 180.0, tree: Path | None = None, python: Path | None = None,
                 name: str = "inferd") -> ServerProc:
    """``inferd serve`` with the prod overlay, quiet logs, on a free port; returns once it is ready.

    ``tree`` and ``python``: another checkout's code and configs, run by another venv's Python (--compare).
    """
    port = free_port()
    # On 127.0.0.1 and the free port, unless the caller's extra_env names its own.
    env = inferd_env(model_path, torch_threads,
                     {"INFERD__SERVER__HOST": "127.0.0.1", "INFERD__SERVER__PORT": str(port), **extra_env},
                     config_dir, tree)
    server = _spawn(name, [str(python or sys.executable), "-m", "inferd.cli", "serve"], env, port, log_dir, cwd=tree)
    server.wait_ready("/health/ready", timeout)
    return server


def start_naive(log_dir: Path, app_file: Path, model_path: Path, torch_threads: int | None,
                timeout: float = 180.0) -> ServerProc:
    """The seed's stage-1 server (bench/naive_server.py) under uvicorn, on a free port."""
    port = free_port()
    app_file = app_file.resolve()  # the server runs in the log folder
    env = _base_env(torch_threads)
    env["NAIVE_MODEL_PATH"] = str(model_path)
    if torch_threads:
        env["NAIVE_TORCH_THREADS"] = str(torch_threads)
    cmd = [sys.executable, "-m", "uvicorn", f"{app_file.stem}:app", "--app-dir", str(app_file.parent),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"]
    server = _spawn("naive", cmd, env, port, log_dir)
    server.wait_ready("/health", timeout)
    return server


class Starts:
    """Servers started ahead of the phases that use them, each start in its own thread, so that the starts
    overlap instead of queueing (``--quick``: a smoke run's minutes go to starting servers; its figures mean
    nothing). A phase takes its server by name, or starts it then and there if none was started ahead, as a
    real run does: there every server starts when its phase begins, with nothing else running. Whatever was
    started ahead and never taken is stopped by ``close``."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[str, Future[ServerProc]] = {}

    def ahead(self, name: str, start: Callable[[], ServerProc]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(thread_name_prefix="bench-start")
        self._ahead[name] = self._pool.submit(start)

    def take(self, name: str, start: Callable[[], ServerProc]) -> ServerProc:
        """The server started ahead as ``name`` once it is ready (its start's error, if it failed), or
        ``start()`` now."""
        future = self._ahead.pop(name, None)
        return start() if future is None else future.result()

    def close(self) -> None:
        for future in self._ahead.values():
            with contextlib.suppress(Exception):
                future.result().stop()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown()


class Stoppable(Protocol):
    def stop(self) -> None: ...


P = TypeVar("P", bound=Stoppable)


def start_together(starts: list[Callable[[], P]]) -> list[P]:
    """Start servers at once, each start in its own thread (for servers that are up side by side before any of
    them is measured); returns them in order. If a start fails, the ones that started are stopped and the first
    failure is raised."""
    with ThreadPoolExecutor(max_workers=len(starts) or 1, thread_name_prefix="bench-start") as pool:
        futures = [pool.submit(start) for start in starts]
    started: list[P] = []
    failures: list[BaseException] = []
    for future in futures:
        try:
            started.append(future.result())
        except BaseException as exc:  # every start is waited for, then the started ones are stopped
            failures.append(exc)
    if failures:
        stop_together(started)
        raise failures[0]
    return started


def stop_together(servers: Iterable[Stoppable]) -> None:
    """Stop servers at once: each waits for its drain and its process's exit, which take seconds."""
    with ThreadPoolExecutor(thread_name_prefix="bench-stop") as pool:
        list(pool.map(lambda server: server.stop(), servers))
