"""Stopping the fleet under load, and nginx's answers when no worker can answer (real nginx, rendered config)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from settingskit import make_settings

from inferd.fleet.host import nginx_user
from inferd.fleet.layout import Layout, WorkerSlot, free_port
from inferd.fleet.render import Fleet as Rendered
from inferd.fleet.run_dir import write_run_dir

from .fleetkit import NGINX, ClosedLoop, Fleet, requires_nginx

pytestmark = requires_nginx
TEXTS = ["hello world", "the cat is on the mat", "a long river runs by the city", "我们 的 模型", "yes no ok"]
# What a client may see for a request nginx never accepted, once the fleet is stopping (and only then).
NOT_ACCEPTED = {"ConnectError", "RemoteProtocolError", "ReadError"}


def test_sigterm_under_load_finishes_accepted_requests_and_leaves_nothing(
        fleet_factory: Callable[..., Fleet]) -> None:
    fleet = fleet_factory()
    with ClosedLoop(fleet.url, TEXTS, users=8, per_request=4, stop_on_connect_error=True) as load:
        time.sleep(2.0)
        fleet.track()
        sigterm = time.monotonic()
        fleet.proc.send_signal(signal.SIGTERM)
        rc = fleet.proc.wait(180)
    result = load.stop()
    assert rc == 0, fleet.output()[-3000:]
    assert set(result.statuses) == {200}, (result.statuses, result.bodies[:3])
    failed = [a for a in result.answers if a["status"] is None]
    assert {a["error"] for a in failed} <= NOT_ACCEPTED, result.errors
    assert all(a["done"] >= sigterm for a in failed)  # refusals only once the fleet was stopping
    straddling = [a for a in result.answers if a["status"] == 200 and a["sent"] < sigterm < a["done"]]
    assert straddling, "no request was in flight at the SIGTERM"
    assert fleet.alive() == [] and fleet.listening() == []
    out = fleet.output()
    assert "stopped (supervisord exit status 0)" in out
    assert out.index("stopped: nginx") < out.index("stopped: worker-0")  # nginx first, then the drained workers
    assert not (fleet.run_dir / "supervisor.sock").exists()
    assert json.loads((fleet.run_dir / "health" / "fleet.json").read_text())["status"] == "stopped"


# -- nginx alone, in front of workers that cannot answer ------------------------------------------------------------


class Silent:
    """A TCP listener that accepts connections and never answers: a hung worker."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def nginx_before(tmp_path: Path) -> Iterator[Callable[[list[int]], str]]:
    """Start nginx alone from the fleet's rendered nginx.conf, its upstream the given ports; returns its URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(ports: list[int]) -> str:
        run = tmp_path / f"run{len(procs)}"
        settings = make_settings(tmp_path, layered="dev", fleet={"port": free_port(), "proxy_read_timeout_s": 1})
        workers = tuple(WorkerSlot(i, f"worker-{i}", p, free_port(), None, 1, None) for i, p in enumerate(ports))
        user, _ = nginx_user(None, run)
        fleet = Rendered(settings, Layout(workers, (), 2), run, free_port(), NGINX or "nginx", "key", user)
        write_run_dir(fleet, {})
        cmd = [fleet.nginx, "-e", str(run / "logs" / "nginx-error.log"), "-p", f"{run}/nginx/", "-c",
               str(run / "nginx.conf")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{settings.fleet.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health/fleet", timeout=2)
                return url
            except httpx.TransportError:
                assert time.monotonic() < deadline and procs[-1].poll() is None, "nginx did not start"
                time.sleep(0.05)

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_no_worker_listening_is_a_json_502_with_retry_after(nginx_before: Callable[[list[int]], str]) -> None:
    url = nginx_before([free_port(), free_port()])
    r = httpx.post(url + "/predict", json={"texts": ["a"]}, headers={"X-Request-ID": "nobody-home"}, timeout=30)
    assert r.status_code == 502 and r.headers["retry-after"] == "1"
    assert r.headers["x-request-id"] == "nobody-home"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["code"] == "no_worker_available"


def test_no_worker_answering_in_time_is_a_json_504(nginx_before: Callable[[list[int]], str]) -> None:
    hung = [Silent(), Silent()]
    try:
        url = nginx_before([s.port for s in hung])
        r = httpx.post(url + "/predict", json={"texts": ["a"]}, timeout=60)
    finally:
        for s in hung:
            s.close()
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["type"] == "timeout_error" and err["code"] == "upstream_timeout"
    assert all(s.conns for s in hung)  # the request was retried on the second worker before giving up
