"""Pathological bodies against a real server: each is refused in the error shape, and the event loop keeps
answering /health/live meanwhile (a stall measured with a concurrent probe: a correctness property).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import Server

ADMIN = {"Authorization": "Bearer admin-secret"}
STALL_LIMIT_S = 0.1


def _join(parts: list[bytes]) -> bytes:
    return b",".join(parts)


# All under the default 1 MiB body limit: what a client may send without being refused for size.
BODIES = {
    # 90,000 unknown keys: pydantic built an error for each (0.48 s on the event loop).
    "unknown keys": ("/predict", b'{"texts":["a"],' + _join([b'"k%d":0' % i for i in range(90_000)]) + b"}",
                     422, "k0"),
    "unknown keys (admin)": ("/admin/models/reload",
                             b'{"path":"x","version":"v9",' + _join([b'"k%d":0' % i for i in range(90_000)]) + b"}",
                             422, "k0"),
    # 300,000 empty lists: the garbage collector walked them while they were built (1.3 s).
    "300k lists": ("/predict", b'{"texts":[' + _join([b"[]"] * 300_000) + b"]}", 422, "texts"),
    "300k objects": ("/v1/embeddings", b'{"input":["a",' + _join([b"{}"] * 300_000) + b"]}", 422, "input"),
    "one text of 300k lists": ("/predict", b'{"texts":[[' + _join([b"[]"] * 300_000) + b"]]}", 422, "texts[0]"),
    "480k numbers": ("/v1/embeddings", b'{"input":[' + _join([b"1"] * 480_000) + b"]}", 422, "input"),
    "480k numbers in texts": ("/predict", b'{"texts":[' + _join([b"1"] * 480_000) + b"]}", 422, "texts"),
    "a model field of 80k keys": ("/predict", b'{"texts":["a"],"model":{'
                                  + _join([b'"k%d":0' % i for i in range(80_000)]) + b"}}", 422, "model"),
    "deep nesting": ("/predict", b'{"texts":' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400, None),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    return module_serve({
        "INFERD__MODEL__TASK": "fakes:HashHandler", "INFERD__MODEL__PATH": str(tmp_path_factory.mktemp("m")),
        "INFERD__MODEL__LOAD_MODE": "eager", "INFERD__SERVER__ADMIN_KEY": "admin-secret",
        "INFERD__SERVER__ACCESS_LOG": "false"}, wait="/health/ready", clean_exit=True)


def worst_probe_while(server: Server, path: str, body: bytes) -> tuple[httpx.Response, float]:
    """Send ``body`` while another connection probes /health/live; the slowest probe answer, in seconds."""
    stop, started = threading.Event(), threading.Event()
    latencies: list[float] = []

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get("/health/live").status_code == 200
                latencies.append(time.perf_counter() - t0)
                started.set()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        assert started.wait(10)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            response = c.post(path, content=body, headers={"Content-Type": "application/json", **ADMIN})
        time.sleep(0.02)  # a probe sent at the very end of the request is answered too
    finally:
        stop.set()
        thread.join(10)
    return response, max(latencies)


@pytest.mark.parametrize("name", list(BODIES))
def test_a_pathological_body_is_refused_without_stalling_the_event_loop(server: Server, name: str) -> None:
    path, body, status, param = BODIES[name]
    assert len(body) <= 1_048_576
    worst = []
    # The best of three: a stall of the event loop happens every time; a scheduling hiccup of this shared
    # machine (other processes) does not.
    for _ in range(3):
        response, slowest = worst_probe_while(server, path, body)
        assert response.status_code == status, response.text[:300]
        error = response.json()["error"]
        assert set(error) == {"message", "type", "code", "param"} and error["param"] == param
        worst.append(slowest)
    assert min(worst) < STALL_LIMIT_S, f"/health/live waited {[round(w * 1e3) for w in worst]} ms"
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.post("/predict", json={"texts": ["still serving"]}).status_code == 200
