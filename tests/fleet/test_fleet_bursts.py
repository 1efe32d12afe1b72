"""Bursts through a real fleet (nginx, supervisord, two workers) while a worker is not at its best.

While at least one worker is ready, no request may get 502: a worker that is loading, draining or overloaded
answers 503, nginx tries the other one, and a client whose request every worker refused gets the last
worker's own 503 with Retry-After (never nginx's 502 "no live upstreams"). A worker that is not ready is out of
every request's path that way, and back in it as soon as it is ready.

Each burst is ``BURST`` concurrent requests, each on its own connection, as a client fleet would send them.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from .fleetkit import Fleet, finish, requires_nginx, start_fleet

pytestmark = requires_nginx

BURST = 64
ERROR_KEYS = {"message", "type", "code", "param"}


def burst(url: str, n: int = BURST, text: str = "short text") -> list[dict[str, Any]]:
    def one(i: int) -> dict[str, Any]:
        try:
            r = httpx.post(url + "/predict", json={"texts": [f"{text} {i}"]}, timeout=120)
        except httpx.HTTPError as exc:
            return {"status": type(exc).__name__}
        out: dict[str, Any] = {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
        if r.status_code != 200:
            out["body"] = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        return out

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def check(answers: list[dict[str, Any]], allow_503: bool = False) -> Counter[Any]:
    """Zero 502 and no transport error; 200, or (when allowed) a worker's own 503 with Retry-After."""
    statuses = Counter(a["status"] for a in answers)
    wanted = {200, 503} if allow_503 else {200}
    assert set(statuses) <= wanted, (statuses, [a for a in answers if a["status"] != 200][:3])
    for a in answers:
        if a["status"] == 503:
            err = a["body"]["error"]
            assert set(err) == ERROR_KEYS, a
            # inferd's refusal, passed through: not nginx's own error page (code "overloaded" / 502's)
            assert err["code"] == "queue_full" and a["retry_after"], a
    return statuses


def upstreams_since(fleet: Fleet, mark: int) -> Counter[str]:
    """How many requests nginx's access log sent to each worker address since ``mark`` (a byte offset)."""
    text = fleet.log("nginx-access")[mark:]
    return Counter(addr for line in re.findall(r'"upstream_addr":"([^"]*)"', text) for addr in line.split(", "))


def tries_since(fleet: Fleet, mark: int) -> list[tuple[list[str], list[str]]]:
    """Per request since ``mark``: the worker addresses nginx tried, in order, and what each answered."""
    out = []
    for line in fleet.log("nginx-access")[mark:].splitlines():
        addrs = re.search(r'"upstream_addr":"([^"]*)"', line)
        statuses = re.search(r'"upstream_status":"([^"]*)"', line)
        if addrs and statuses and '"uri":"/predict"' in line:
            out.append((addrs.group(1).split(", "), statuses.group(1).split(", ")))
    return out


def worker_status(fleet: Fleet, name: str) -> str:
    port = next(w["port"] for w in fleet.workers if w["name"] == name)
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5).json().get("status", "?")
    except (httpx.HTTPError, ValueError):
        return "unreachable"


@pytest.fixture
def fake_fleet(tmp_path: Path) -> Iterator[Callable[..., tuple[Fleet, Path]]]:
    """Fleets of the fake task: a worker's load waits while gates/hold-load exists, a batch of 'hold:X' texts
    until gates/X exists."""
    started: list[tuple[Fleet, Path]] = []

    def make(**env: str) -> tuple[Fleet, Path]:
        folder = tmp_path / f"fleet{len(started)}"
        gates, model = folder / "gates", folder / "model"
        for path in (folder, gates, model):
            path.mkdir()
        fleet = start_fleet(folder, model, {"INFERD__MODEL__TASK": "fakes:HashHandler", "FAKE_GATE_DIR": str(gates),
                                            "FAKE_LOAD_HOLD": str(gates / "hold-load"),
                                            "INFERD__SERVER__DRAIN_TIMEOUT_S": "3", **env})
        started.append((fleet, gates))
        return fleet, gates

    yield make
    for fleet, gates in started:
        (gates / "hold-load").unlink(missing_ok=True)
        (gates / "w1").touch()
        finish(fleet)


def test_a_burst_right_after_health_is_200(tmp_path: Path, tiny_model: Path) -> None:
    """As a user meets a new fleet: poll /health through nginx, and burst as soon as it says 200."""
    (tmp_path / "fleet").mkdir()
    fleet = start_fleet(tmp_path / "fleet", tiny_model, {"INFERD__MODEL__LOAD_DELAY_S": "1"}, wait=False)
    try:
        deadline = time.monotonic() + 300
        while True:
            fleet.track()
            assert fleet.proc.poll() is None and time.monotonic() < deadline, fleet.output()[-3000:]
            try:
                if httpx.get(fleet.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        check(burst(fleet.url))
        fleet.wait_ready()
        check(burst(fleet.url))
    finally:
        finish(fleet)


def test_a_burst_while_one_worker_is_loading(fake_fleet: Callable[..., tuple[Fleet, Path]]) -> None:
    fleet, gates = fake_fleet()
    (gates / "hold-load").touch()
    sup = fleet.supervisor()
    sup.rpc.supervisor.stopProcess("workers:worker-1")
    sup.rpc.supervisor.startProcess("workers:worker-1")  # back, listening, and held in its load
    deadline = time.monotonic() + 120
    while worker_status(fleet, "worker-1") != "loading":
        assert time.monotonic() < deadline, fleet.log("worker-1")[-3000:]
        time.sleep(0.1)
    worker1 = f"127.0.0.1:{next(w['port'] for w in fleet.workers if w['name'] == 'worker-1')}"
    for _ in range(2):
        mark = len(fleet.log("nginx-access"))
        check(burst(fleet.url))
        # Out of every request's path: what nginx tried on worker-1 it was refused (503) and sent on.
        tried = [t for t in tries_since(fleet, mark) if worker1 in t[0]]
        assert tried, "nginx never tried the loading worker: the test did not exercise the retry"
        assert all(dict(zip(addrs, statuses, strict=True)).get(worker1) == "503" and statuses[-1] == "200"
                   for addrs, statuses in tried), tried[:5]
    (gates / "hold-load").unlink()
    while worker_status(fleet, "worker-1") != "ready":
        assert time.monotonic() < deadline + 60, fleet.log("worker-1")[-3000:]
        time.sleep(0.1)
    mark = len(fleet.log("nginx-access"))
    check(burst(fleet.url))
    assert upstreams_since(fleet, mark)[worker1] > 0, "worker-1 never came back into rotation"


def test_a_burst_while_one_worker_is_overloaded(fake_fleet: Callable[..., tuple[Fleet, Path]]) -> None:
    # Tiny queues: one text per batch, two texts queued at most, so a held worker is soon overloaded.
    fleet, gates = fake_fleet(INFERD__BATCHING__MAX_QUEUE="2", INFERD__BATCHING__MAX_BATCH_SIZE="1")
    port = next(w["port"] for w in fleet.workers if w["name"] == "worker-1")
    held: list[httpx.Response | BaseException] = []

    def hold() -> None:
        try:
            held.append(httpx.post(f"http://127.0.0.1:{port}/predict", json={"texts": ["hold:w1 x"]}, timeout=120))
        except httpx.HTTPError as exc:
            held.append(exc)

    # One batch held running, two queued: worker-1's queue (max_queue 2) is full, so it answers 503.
    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    r = httpx.post(f"http://127.0.0.1:{port}/predict", json={"texts": ["one more"]}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
    try:
        statuses = Counter[Any]()
        for _ in range(3):
            statuses += check(burst(fleet.url), allow_503=True)
        assert statuses[200] > 0, statuses  # worker-0 served what it could; the rest was refused as 503s
    finally:
        (gates / "w1").touch()
        for t in threads:
            t.join(60)
    assert all(isinstance(h, httpx.Response) and h.status_code == 200 for h in held), held


def test_a_burst_during_a_fleet_reload(fleet_factory: Any, tiny_model_v2: Path) -> None:
    fleet = fleet_factory({"INFERD__MODEL__LOAD_DELAY_S": "2"})
    done = threading.Event()
    out: list[Any] = []

    def reload() -> None:
        try:
            out.append(fleet.cli("reload", "--path", str(tiny_model_v2), "--version", "v2"))
        finally:
            done.set()

    thread = threading.Thread(target=reload)
    thread.start()
    bursts = 0
    try:
        while not done.is_set() or bursts < 2:
            check(burst(fleet.url))
            bursts += 1
    finally:
        thread.join(300)
    assert out and out[0].returncode == 0, out and (out[0].stdout + out[0].stderr)
    assert bursts >= 2
    r = httpx.post(fleet.url + "/predict", json={"texts": ["after"]}, timeout=60)
    assert r.status_code == 200 and r.headers["x-model-version"] == "v2"
