"""Loading modes against real server processes: background readiness, lazy load-once, failures.

Eager mode (ready as soon as the port answers) is checked by the module server of test_api.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import Server
from tinymodel import write_tiny_bert

from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec

ERROR_KEYS = {"message", "type", "code", "param"}


def assert_503_retry(r: httpx.Response) -> dict:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    return r.json()


def assert_not_ready_error(r: httpx.Response) -> dict:
    body = assert_503_retry(r)
    assert set(body["error"]) == ERROR_KEYS
    return body["error"]


def test_background_mode_turns_ready_while_live_throughout(serve, tiny_model: Path) -> None:
    server: Server = serve({"INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__LOAD_MODE": "background",
                            "INFERD__MODEL__LOAD_DELAY_S": "4"}, wait="/health/live")
    with server.client() as c:
        # The port is open and the model is still loading.
        assert assert_503_retry(c.get("/health/ready")) == {"status": "loading"}
        assert assert_503_retry(c.get("/health")) == {"status": "loading"}
        assert "loading" in assert_not_ready_error(c.post("/predict", json={"texts": ["hello"]}))["message"]
        assert_not_ready_error(c.post("/v1/embeddings", json={"input": "hello"}))
        # Bad input is still bad input while loading: validation does not wait for the model.
        assert c.post("/predict", json={"texts": []}).status_code == 422
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            live = c.get("/health/live")
            assert live.status_code == 200 and live.json()["status"] == "alive"
            r = c.get("/health/ready")
            seen.append(r.status_code)
            if r.status_code == 200:
                assert r.json()["status"] == "ready"
                break
            assert r.json() == {"status": "loading"}
            time.sleep(0.1)
        assert seen[-1] == 200, server.log()[-3000:]
        assert c.get("/health").status_code == 200
        assert c.post("/predict", json={"texts": ["hello"]}).status_code == 200
    assert server.log().count("model ready") == 1


def test_lazy_mode_loads_once_under_concurrent_first_requests(serve, tiny_model: Path) -> None:
    server: Server = serve({"INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__LOAD_MODE": "lazy",
                            "INFERD__MODEL__LOAD_DELAY_S": "1"}, wait="/health/live")
    with server.client() as c:
        # Routable before any request (the first request is what loads the model), yet nothing loaded.
        r = c.get("/health/ready")
        assert r.status_code == 200 and r.json() == {"status": "ready", "model": "all-MiniLM-L6-v2", "loaded": False}
        assert c.get("/info").json()["state"] == "not_loaded"
    assert "model ready" not in server.log()

    async def twenty() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=20)) as ac:
            return await asyncio.gather(*(ac.post("/predict", json={"texts": [f"hello {i % 3}"]})
                                          for i in range(20)))

    responses = asyncio.run(twenty())
    assert [r.status_code for r in responses] == [200] * 20, [r.text for r in responses if r.status_code != 200]
    # Same text, same vector, whichever request triggered the load.
    vectors = [r.json()["results"][0] for r in responses]
    for i in range(3, 20):
        np.testing.assert_allclose(vectors[i], vectors[i % 3], atol=1e-6)
    log = server.log()
    assert log.count("model ready") == 1, log[-3000:]
    assert log.count("Loading weights: 100%") <= 1
    with server.client() as c:
        assert c.get("/info").json()["state"] == "ready"


def test_failed_load_keeps_the_process_up_and_says_why_to_the_log_and_the_admin(serve, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    server: Server = serve({"INFERD__MODEL__PATH": str(missing), "INFERD__SERVER__ADMIN_KEY": "adm"},
                           wait="/health/live")
    with server.client() as c:
        deadline = time.monotonic() + 60
        while (r := c.get("/health/ready")).json().get("status") == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        body = assert_503_retry(r)
        # Publicly only "failed": the cause names filesystem paths.
        assert body["status"] == "failed" and str(tmp_path) not in r.text, body
        assert c.get("/health/live").status_code == 200
        busy = c.post("/predict", json={"texts": ["hello"]})
        err = assert_not_ready_error(busy)
        assert err["code"] == "model_failed" and str(tmp_path) not in busy.text
        assert c.get("/info").json()["state"] == "failed"
        admin = c.get("/admin/models", headers={"Authorization": "Bearer adm"}).json()
        assert admin["state"] == "failed" and str(missing) in admin["reason"]
    assert server.proc.poll() is None
    assert "model load failed" in server.log() and str(missing) in server.log()


@pytest.mark.parametrize("mode", ["background", "eager"])
def test_failed_load_exits_non_zero_when_configured(serve, tmp_path: Path, mode: str) -> None:
    missing = tmp_path / "no-such-model"
    server: Server = serve({"INFERD__MODEL__PATH": str(missing), "INFERD__MODEL__LOAD_MODE": mode,
                            "INFERD__MODEL__EXIT_ON_LOAD_FAILURE": "true"}, wait=None)
    rc = server.proc.wait(60)
    assert rc != 0
    assert str(missing) in server.log()


def test_a_failed_lazy_load_exits_non_zero_when_configured(serve, tmp_path: Path) -> None:
    # Lazy mode loads on the first request: that request gets its 503, then the process exits.
    missing = tmp_path / "no-such-model"
    server: Server = serve({"INFERD__MODEL__PATH": str(missing), "INFERD__MODEL__LOAD_MODE": "lazy",
                            "INFERD__MODEL__EXIT_ON_LOAD_FAILURE": "true"}, wait="/health/ready")
    with server.client() as c:
        err = assert_not_ready_error(c.post("/predict", json={"texts": ["hello"]}))
        assert err["code"] == "model_failed"
    assert server.proc.wait(30) == 3
    assert "exit_on_load_failure" in server.log() and str(missing) in server.log()


# -- in-process: the weight format rules through the real loader -----------------------------------------------


def test_pickle_weights_are_refused_unless_allowed(tiny_model: Path, tmp_path: Path) -> None:
    # Same seed as tiny_model: the same weights, saved as pytorch_model.bin instead of safetensors.
    pickled = write_tiny_bert(tmp_path / "pickled", seed=1, pickle_weights=True)
    assert not list(pickled.glob("*.safetensors"))
    spec = ModelSpec(path=pickled, name="tiny", version="p", device="cpu", warmup=False)
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        load_handler(spec)
    allowed = load_handler(ModelSpec(path=pickled, name="tiny", version="p", device="cpu", warmup=False,
                                     allow_pickle=True))
    reference = load_handler(ModelSpec(path=tiny_model, name="tiny", version="s", device="cpu", warmup=False))
    texts = ["hello world", "the cat and the dog"]
    np.testing.assert_allclose(allowed.infer(allowed.preprocess(texts)),
                               reference.infer(reference.preprocess(texts)), atol=1e-6)
