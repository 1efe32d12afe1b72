"""Helpers of the fleet tests: a real ``inferd fleet`` (supervisord, nginx, ``inferd serve`` workers) on free
127.0.0.1 ports, and a closed-loop load of threads.

Everything a test starts is stopped, even when it fails: SIGTERM to the fleet, then SIGKILL to every process
it ever had (tracked with psutil while it runs), then a check that none of its ports still listens.
(A module of its own, not conftest.py: tests/conftest.py is imported as ``conftest`` already.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from inferd.fleet.control import RunDir, Supervisor, status
from inferd.fleet.layout import free_port

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
requires_nginx = pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; .ci/run installs it)")
# The machine has two cores shared by every engineer's tests: starting Python + torch can take a minute.
READY_TIMEOUT_S = 300.0


def fleet_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERD") and k != "MODEL_PATH"}
    env.update({
        "INFERD_ENV": "dev", "INFERD_CONFIG_DIR": str(ROOT / "configs"),
        "INFERD__SERVER__LOG_LEVEL": "INFO", "INFERD__RUNTIME__TORCH_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    })
    env.update(extra or {})
    return env


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    port: int
    out_path: Path
    env: dict[str, str]
    procs: dict[int, psutil.Process] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "layout.json").read_text())

    @property
    def workers(self) -> list[dict[str, Any]]:
        return self.meta["workers"]

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def log(self, name: str) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def supervisor(self) -> Supervisor:
        return Supervisor(self.run_dir / "supervisor.sock")

    def status(self, detailed: bool = False) -> dict[str, Any]:
        return status(RunDir(self.run_dir), detailed=detailed)

    def cli(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """``inferd fleet <args> --run-dir <this fleet>`` as an operator would type it."""
        return subprocess.run([sys.executable, "-m", "inferd.cli", "fleet", *args, "--run-dir", str(self.run_dir)],
                              env=self.env, capture_output=True, text=True, timeout=timeout)

    def track(self) -> None:
        """Remember every process of the fleet seen so far (supervisord, nginx, workers, restarted ones too)."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.procs.setdefault(p.pid, p)

    def ports(self) -> list[int]:
        try:
            meta = self.meta
        except (OSError, ValueError):
            return [self.port]
        return [self.port, meta["status_port"], *(p for w in meta["workers"] for p in (w["port"], w["admin_port"]))]

    def listening(self) -> list[int]:
        return [p for p in self.ports() if _accepts(p)]

    def alive(self) -> list[int]:
        # psutil.Process remembers each process's start time: a pid reused by another process is not ours.
        alive = []
        for pid, p in self.procs.items():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        return alive

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.track()
            if self.proc.poll() is not None:
                raise AssertionError(f"inferd fleet exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            if "ready:" in self.output():
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        self.track()
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"fleet not ready after {timeout}s:\n{self.output()[-4000:]}\n"
                             f"worker-0 log:\n{self.log('worker-0')[-3000:]}")

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM as an operator would; whatever is still running after ``timeout`` is killed."""
        self.track()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill_everything()
        return self.proc.returncode

    def kill_everything(self) -> None:
        """SIGKILL the fleet and every process it had that still runs (by pid and start time, never by name)."""
        self.track()
        if self.proc.poll() is None:
            self.proc.kill()
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_fleet(folder: Path, model: Path, env: dict[str, str] | None = None, args: list[str] | None = None,
                wait: bool = True) -> Fleet:
    """``inferd fleet`` with two workers on the tiny model (version v1) and nginx on a free port."""
    port = free_port()
    run_dir = folder / "run"
    full_env = fleet_env(env)
    out_path = folder / "fleet.out"
    cmd = [sys.executable, "-m", "inferd.cli", "fleet", "--workers", "2", "--port", str(port), "--run-dir",
           str(run_dir), "--model-path", str(model), "--model-version", "v1", *(args or [])]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=folder,
                                start_new_session=True)
    fleet = Fleet(proc, run_dir, port, out_path, full_env)
    if wait:
        try:
            fleet.wait_ready()
        except BaseException:
            fleet.kill_everything()
            raise
    return fleet


def finish(fleet: Fleet) -> None:
    """Stop a fleet and check that nothing of it is left running or listening."""
    fleet.stop()
    left = fleet.alive()
    listening = fleet.listening()
    fleet.kill_everything()
    assert not left, f"processes of the fleet still running: {left}"
    assert not listening, f"ports of the fleet still listening: {listening}"


@dataclass
class LoadResult:
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    answers: list[dict[str, Any]] = field(default_factory=list)  # status, version, texts, vectors, sent, done
    bodies: list[str] = field(default_factory=list)  # non-200 bodies, for the failure message


class ClosedLoop:
    """``users`` threads, each sending its next request when the last is answered, until stopped."""

    def __init__(self, url: str, texts: list[str], users: int = 8, per_request: int = 2,
                 stop_on_connect_error: bool = False, keep: bool = False) -> None:
        self.url, self.texts, self.users, self.per_request = url, texts, users, per_request
        self.stop_on_connect_error, self.keep = stop_on_connect_error, keep
        self.result = LoadResult()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._user, args=(i,), daemon=True) for i in range(users)]

    def __enter__(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        return self.result

    def _user(self, i: int) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                texts = [self.texts[(i * 7 + n + k) % len(self.texts)] for k in range(self.per_request)]
                n += 1
                sent = time.monotonic()
                try:
                    r = client.post("/predict", json={"texts": texts})
                except httpx.HTTPError as exc:
                    with self._lock:
                        self.result.errors[type(exc).__name__] += 1
                        self.result.answers.append({"status": None, "error": type(exc).__name__, "sent": sent,
                                                    "done": time.monotonic(), "message": str(exc)})
                    if self.stop_on_connect_error:
                        return
                    continue
                done = time.monotonic()
                with self._lock:
                    self.result.statuses[r.status_code] += 1
                    if r.status_code != 200:
                        self.result.bodies.append(r.text[:300])
                    entry: dict[str, Any] = {"status": r.status_code, "sent": sent, "done": done}
                    if self.keep and r.status_code == 200:
                        body = r.json()
                        entry.update(texts=texts, version=r.headers.get("x-model-version"), model=body["model"],
                                     vectors=body["results"])
                    self.result.answers.append(entry)
