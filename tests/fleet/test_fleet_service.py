"""A real fleet (supervisord, nginx, two ``inferd serve`` workers on the tiny model) acting as one service.

One fleet for the module. Stage-1 behaviour through nginx is compared with the same request sent straight to a
worker; then a worker is killed under load, the model is reloaded under load, and a reload one worker refuses
is undone everywhere. Every test reads the state it starts from, so they do not depend on each other's order.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from .fleetkit import ClosedLoop, Fleet, finish, requires_nginx, start_fleet

pytestmark = requires_nginx

MAX_ITEMS = 4
MAX_CHARS = 2000
MAX_BODY = 16_384
ERROR_KEYS = {"message", "type", "code", "param"}
# Every load is slowed by this much (model.load_delay_s): a reload's second worker is still waiting when the
# test breaks the model folder under it, so the refusal test is deterministic.
LOAD_DELAY_S = 2.0
ENV = {
    "INFERD__LIMITS__MAX_ITEMS_PER_REQUEST": str(MAX_ITEMS),
    "INFERD__LIMITS__MAX_CHARS_PER_TEXT": str(MAX_CHARS),
    "INFERD__LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
    "INFERD__MODEL__LOAD_DELAY_S": str(LOAD_DELAY_S),
}
TEXTS = ["hello world", "the cat is on the mat", "a long river runs by the city", "我们 的 模型",
         "read write test data", "one two three four five", "the dog and the house", "fast slow batch queue",
         "memory error network", "yes no ok", "server client request response", "tree mountain car walk"]


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = start_fleet(tmp_path_factory.mktemp("fleet"), tiny_model, ENV)
    try:
        yield fleet
    finally:
        finish(fleet)


@pytest.fixture(scope="module")
def proxy(fleet: Fleet) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fleet.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def direct(fleet: Fleet) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{fleet.workers[0]['port']}", timeout=60) as client:
        yield client


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert r.headers["x-request-id"]
    return body["error"]


def same_refusal(via: httpx.Response, straight: httpx.Response) -> None:
    """nginx's answer is the worker's: same status, same error type, code and param."""
    assert via.status_code == straight.status_code, (via.text, straight.text)
    a, b = error_of(via), error_of(straight)
    assert (a["type"], a["code"], a["param"]) == (b["type"], b["code"], b["param"]), (a, b)


def active_versions(fleet: Fleet) -> dict[str, str]:
    key = (fleet.run_dir / "admin.key").read_text().strip()
    out = {}
    for w in fleet.workers:
        r = httpx.get(f"http://127.0.0.1:{w['admin_port']}/admin/models", headers={"Authorization": f"Bearer {key}"},
                      timeout=30)
        r.raise_for_status()
        out[w["name"]] = next(s["version"] for s in r.json()["slots"] if s["role"] == "active")
    return out


def vectors(client: httpx.Client, texts: list[str]) -> tuple[str, np.ndarray]:
    """The vectors of ``texts`` (MAX_ITEMS per request) and the one version that computed them all."""
    versions, out = set(), []
    for i in range(0, len(texts), MAX_ITEMS):
        r = client.post("/predict", json={"texts": texts[i:i + MAX_ITEMS]})
        assert r.status_code == 200, r.text
        versions.add(r.headers["x-model-version"])
        out.extend(r.json()["results"])
    assert len(versions) == 1, versions
    return versions.pop(), np.array(out)


# -- stage 1 through nginx --------------------------------------------------------------------------------------


def test_every_endpoint_answers_through_nginx_as_directly(proxy: httpx.Client, direct: httpx.Client) -> None:
    version, via = vectors(proxy, TEXTS[:3])
    straight_version, straight = vectors(direct, TEXTS[:3])
    assert version == straight_version
    np.testing.assert_allclose(via, straight, atol=1e-5)
    r = proxy.post("/v1/embeddings", json={"input": ["hello world"], "encoding_format": "base64"})
    assert r.status_code == 200 and r.json()["data"][0]["embedding"]
    assert proxy.get("/v1/models").json()["data"][0]["versions"][0]["version"] == version
    assert proxy.get("/info").json()["version"] == version
    for path in ("/health", "/health/ready", "/health/live"):
        assert proxy.get(path).status_code == 200, path


RAW_BAD = [  # the malformed bodies of tests/integration/test_api.py
    ("/predict", b"{not json"), ("/predict", b'{"texts": ["\xff\xfe bad utf-8"]}'),
    ("/v1/embeddings", b'{"input": "\\ud800"}'), ("/predict", b""), ("/predict", b"[1, 2]"),
    ("/v1/embeddings", b'{"input": "a"} trailing'),
]
INVALID = [  # and its invalid requests
    ("/predict", {"texts": "one string"}), ("/predict", {"texts": ["ok", 5]}), ("/predict", {"texts": [None]}),
    ("/predict", {}), ("/predict", {"texts": []}), ("/predict", {"texts": [""]}),
    ("/predict", {"texts": ["ok", " \n "]}), ("/predict", {"texts": ["a"] * (MAX_ITEMS + 1)}),
    ("/predict", {"texts": ["a"], "colour": "red"}), ("/predict", {"texts": ["a"], "priority": "high"}),
    ("/predict", {"texts": ["a"], "timeout_ms": -5}), ("/predict", {"texts": ["ok", "x" * (MAX_CHARS + 1)]}),
    ("/v1/embeddings", {}), ("/v1/embeddings", {"input": 5}), ("/v1/embeddings", {"input": [1, 2, 3]}),
    ("/v1/embeddings", {"input": ""}), ("/v1/embeddings", {"input": ["a"] * (MAX_ITEMS + 1)}),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}), ("/v1/embeddings", {"input": "a", "dimensions": 7}),
    ("/v1/embeddings", {"input": "a", "extra": 1}),
]


@pytest.mark.parametrize(("path", "raw"), RAW_BAD)
def test_malformed_bodies_are_refused_as_directly(proxy: httpx.Client, direct: httpx.Client, path: str,
                                                  raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    same_refusal(proxy.post(path, content=raw, headers=headers), direct.post(path, content=raw, headers=headers))


@pytest.mark.parametrize(("path", "body"), INVALID)
def test_invalid_requests_are_refused_as_directly(proxy: httpx.Client, direct: httpx.Client, path: str,
                                                  body: dict) -> None:
    same_refusal(proxy.post(path, json=body), direct.post(path, json=body))


def test_unknown_route_and_wrong_method_as_directly(proxy: httpx.Client, direct: httpx.Client) -> None:
    same_refusal(proxy.get("/nope"), direct.get("/nope"))
    same_refusal(proxy.get("/predict"), direct.get("/predict"))


def access_log(fleet: Fleet, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """nginx's JSON access-log line of one request (written when the request ends, so wait for it)."""
    deadline = time.monotonic() + timeout
    while True:
        for line in (fleet.run_dir / "logs" / "nginx-access.log").read_text().splitlines():
            entry = json.loads(line)
            if entry["request_id"] == request_id:
                return entry
        assert time.monotonic() < deadline, f"no access-log line for {request_id}"
        time.sleep(0.1)


def test_nginx_413_looks_like_inferds(fleet: Fleet, proxy: httpx.Client, direct: httpx.Client) -> None:
    body = b'{"texts": ["' + b"a " * MAX_BODY + b'"]}'
    headers = {"content-type": "application/json"}
    via = proxy.post("/predict", content=body, headers={**headers, "X-Request-ID": "big-body"})
    straight = direct.post("/predict", content=body, headers=headers)
    same_refusal(via, straight)
    assert error_of(via)["message"] == error_of(straight)["message"]
    assert via.headers["x-request-id"] == "big-body" and float(via.headers["x-process-time"]) >= 0

    def chunks() -> Iterator[bytes]:
        yield b'{"texts": ["'
        for _ in range(MAX_BODY // 1000 + 2):
            yield b"a " * 500
        yield b'"]}'

    chunked = proxy.post("/predict", content=chunks(), headers={**headers, "X-Request-ID": "big-chunked"})
    assert chunked.status_code == 413 and error_of(chunked)["code"] == "body_too_large"
    # nginx refused both itself: no worker was asked.
    for rid in ("big-body", "big-chunked"):
        entry = access_log(fleet, rid)
        assert entry["status"] == 413 and entry["upstream_addr"] == "", entry


def test_oversized_headers_are_refused_as_directly(proxy: httpx.Client, direct: httpx.Client) -> None:
    big = {"X-Padding": "a" * 17_000}
    same_refusal(proxy.post("/predict", json={"texts": ["a"]}, headers=big),
                 direct.post("/predict", json={"texts": ["a"]}, headers=big))


def raw_http(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (b"GARBAGE\r\n\r\n", 400, "bad_request"),
    (b"GET /predict?" + b"a" * 17_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
])
def test_nginx_refusals_use_the_error_shape(fleet: Fleet, request_bytes: bytes, status: int, code: str) -> None:
    head, _, body = raw_http(fleet.port, request_bytes).partition(b"\r\n\r\n")
    assert head.split()[1] == str(status).encode(), head
    assert b"content-type: application/json" in head.lower() and b"x-request-id: " in head.lower()
    err = json.loads(body)["error"]
    assert set(err) == ERROR_KEYS and err["code"] == code


def test_request_id_passes_through_and_nginx_logs_json(fleet: Fleet, proxy: httpx.Client) -> None:
    r = proxy.post("/predict", json={"texts": ["hi"]}, headers={"X-Request-ID": "fleet-id.42"})
    assert r.headers["x-request-id"] == "fleet-id.42"
    generated = proxy.get("/health/live", headers={"X-Request-ID": "has spaces ;"}).headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0  # nginx's own id, the shape of inferd's
    entry = access_log(fleet, "fleet-id.42")
    assert entry["status"] == 200 and entry["upstream_addr"].startswith("127.0.0.1:")
    assert float(entry["upstream_response_time"].split(",")[-1]) >= 0
    # The worker that answered logged the same id.
    assert any("fleet-id.42" in fleet.log(w["name"]) for w in fleet.workers)


def test_fleet_health_targets_and_stub_status(fleet: Fleet, proxy: httpx.Client) -> None:
    health = proxy.get("/health/fleet")
    assert health.status_code == 200 and health.headers["cache-control"] == "no-store"
    data = health.json()
    assert [w["name"] for w in data["workers"]] == ["worker-0", "worker-1"] and data["workers_total"] == 2
    targets = json.loads((fleet.run_dir / "prometheus" / "targets.json").read_text())
    assert [t["labels"]["worker"] for t in targets] == ["worker-0", "worker-1"]
    assert all(t["labels"]["gpu"] == "cpu" for t in targets)
    for t in targets:  # every target is a worker's own /metrics
        assert "inferd_queue_depth" in httpx.get(f"http://{t['targets'][0]}/metrics", timeout=30).text
    assert proxy.get("/metrics").status_code == 404  # one random worker's metrics would mislead
    stub = httpx.get(f"http://127.0.0.1:{fleet.meta['status_port']}/nginx_status", timeout=30)
    assert stub.status_code == 200 and "Active connections" in stub.text


# -- a worker killed under load ---------------------------------------------------------------------------------


def _worker_back(fleet: Fleet, name: str, old_pid: int) -> bool:
    info = fleet.supervisor().processes()[name]
    if info["statename"] != "RUNNING" or info["pid"] in (0, old_pid):
        return False
    port = next(w["port"] for w in fleet.workers if w["name"] == name)
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_kill_9_of_a_worker_under_load_loses_no_request(fleet: Fleet) -> None:
    before = fleet.supervisor().restarts().get("worker-0", 0)
    pid = fleet.supervisor().processes()["worker-0"]["pid"]
    with ClosedLoop(fleet.url, TEXTS, users=8) as load:
        time.sleep(1.0)
        signal_sent = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = signal_sent + 300
        while not _worker_back(fleet, "worker-0", pid):
            assert time.monotonic() < deadline, f"worker-0 not back:\n{fleet.log('worker-0')[-3000:]}"
            time.sleep(0.5)
        time.sleep(1.0)  # a little load on the restarted worker too
    result = load.stop()
    failed = [{**a, "sent": a["sent"] - signal_sent, "done": a["done"] - signal_sent}
              for a in result.answers if a["status"] != 200]
    assert result.errors == {} and set(result.statuses) == {200}, (result.statuses, result.errors, result.bodies[:3],
                                                                   failed[:3])
    assert sum(1 for a in result.answers if a["sent"] > signal_sent) > 0
    status = fleet.cli("status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    worker = next(w for w in json.loads(status.stdout)["workers"] if w["name"] == "worker-0")
    assert worker["restarts"] == before + 1 and worker["ready"] and worker["pid"] != pid
    assert "not expected" in (fleet.run_dir / "logs" / "supervisord.log").read_text()


# -- model changes reach every worker ----------------------------------------------------------------------------


def test_reload_under_load_switches_every_worker_and_loses_nothing(fleet: Fleet, direct: httpx.Client,
                                                                   tiny_model: Path, tiny_model_v2: Path) -> None:
    old = set(active_versions(fleet).values())
    assert len(old) == 1
    (old_version,) = old
    new_version, new_path = ("v2", tiny_model_v2) if old_version != "v2" else ("v1b", tiny_model)
    expected = {old_version: vectors(direct, TEXTS)[1]}
    with ClosedLoop(fleet.url, TEXTS, users=8, keep=True) as load:
        time.sleep(0.5)
        reload = fleet.cli("reload", "--path", str(new_path), "--version", new_version)
        time.sleep(0.5)
    result = load.stop()
    assert reload.returncode == 0, reload.stdout + reload.stderr
    assert set(active_versions(fleet).values()) == {new_version}
    version, expected[new_version] = vectors(direct, TEXTS)
    assert version == new_version and not np.allclose(expected[old_version], expected[new_version], atol=1e-3)
    assert result.errors == {} and set(result.statuses) == {200}, (result.statuses, result.errors, result.bodies[:3])
    seen = {a["version"] for a in result.answers}
    assert new_version in seen
    for a in result.answers:  # every vector is the one its reported version computes
        assert a["model"].endswith(f"@{a['version']}")
        want = expected[a["version"]][[TEXTS.index(t) for t in a["texts"]]]
        np.testing.assert_allclose(np.array(a["vectors"]), want, atol=1e-4)
    config = (fleet.run_dir / "config" / "base.yaml").read_text()
    assert f"version: {new_version}" in config and str(new_path) in config  # a restarted worker comes back on it


def test_a_reload_one_worker_refuses_leaves_every_worker_on_the_old_version(fleet: Fleet, tiny_model_v2: Path,
                                                                           models_root: Path) -> None:
    old = set(active_versions(fleet).values())
    assert len(old) == 1
    config_before = (fleet.run_dir / "config" / "base.yaml").read_text()
    doomed = models_root / f"doomed-{time.monotonic_ns()}"
    shutil.copytree(tiny_model_v2, doomed)
    cmd = [sys.executable, "-m", "inferd.cli", "fleet", "reload", "--run-dir", str(fleet.run_dir),
           "--path", str(doomed), "--version", "v3"]
    with subprocess.Popen(cmd, env=fleet.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        # worker-0 has switched; worker-1's reload is asked next and waits LOAD_DELAY_S before reading the
        # folder, which is gone by then: worker-1 refuses (422), and worker-0 must be switched back.
        for line in proc.stdout:
            if "worker-0: reload done" in line:
                shutil.rmtree(doomed)
                break
        out, err = proc.communicate(timeout=300)
    assert not doomed.exists(), "worker-0 never switched: " + out + err
    assert proc.returncode == 1, out + err
    assert "refused by worker-1" in err and "model_load_failed" in err and "undone on worker-0" in err, err
    assert set(active_versions(fleet).values()) == old
    assert (fleet.run_dir / "config" / "base.yaml").read_text() == config_before
