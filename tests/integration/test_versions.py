"""One version string, one model: against a real server with real (tiny) models and the cache on.

A model change under a version that is being served is refused (409 from the admin API; SIGHUP refuses,
logs and counts it as failed), and the cache answers only for the model that would compute the answer,
even when a version string comes back for another model after the first was retired.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from conftest import ROOT, Server, metric_value, wait_for
from tinymodel import write_tiny_bert

from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec

ADMIN = {"Authorization": "Bearer admin-secret"}
TEXT = "the cat and the dog run in the city"


def reference(path: Path) -> list[float]:
    """TEXT's vector computed in this process, straight through the handler."""
    handler = load_handler(ModelSpec(path=path, name="tiny", version="ref", device="cpu"))
    return [float(v) for v in handler.postprocess(handler.infer(handler.preprocess([TEXT])))[0]]


@pytest.fixture(scope="module")
def tiny_model_v3(models_root: Path) -> Path:
    return write_tiny_bert(models_root / "tiny-v3", seed=3)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, models_root: Path) -> Path:
    folder = tmp_path_factory.mktemp("configs")
    shutil.copy(ROOT / "configs" / "base.yaml", folder / "base.yaml")
    write_model(folder, {"name": "tiny", "path": str(tiny_model), "version": "v1", "root": [str(models_root)]})
    return folder


def write_model(folder: Path, model: dict[str, object]) -> None:
    (folder / "dev.yaml").write_text(yaml.safe_dump({"model": model, "cache": {"max_entries": 1000}}))


@pytest.fixture(scope="module")
def server(module_serve: Callable[..., Server], config_dir: Path) -> Server:
    return module_serve({"INFERD_CONFIG_DIR": str(config_dir), "INFERD__SERVER__ADMIN_KEY": "admin-secret"},
                        wait="/health/ready", clean_exit=True)


def embed(c: httpx.Client, **pin: str) -> tuple[str, list[float]]:
    r = c.post("/predict", json={"texts": [TEXT], **pin})
    assert r.status_code == 200, r.text
    return r.headers["X-Model-Version"], r.json()["results"][0]


def close_to(a: list[float], b: list[float]) -> bool:
    return bool(np.allclose(a, b, atol=1e-5))


def reloads(server: Server, outcome: str) -> float:
    return metric_value(httpx.get(server.url + "/metrics").text, "inferd_model_reloads_total", outcome=outcome)


def test_a_change_under_a_served_version_is_refused_and_the_cache_never_crosses_models(
        server: Server, config_dir: Path, tiny_model: Path, tiny_model_v2: Path, tiny_model_v3: Path,
        models_root: Path) -> None:
    v1, v2, v3 = reference(tiny_model), reference(tiny_model_v2), reference(tiny_model_v3)
    assert not close_to(v1, v2) and not close_to(v1, v3) and not close_to(v2, v3)
    with server.client() as c:
        version, vector = embed(c)
        assert version == "v1" and close_to(vector, v1)
        assert close_to(embed(c)[1], v1)  # now from the cache

        # Another model under the active version's string: 409, named; nothing changes, the cache included.
        r = c.post("/admin/models/reload", json={"path": str(tiny_model_v2), "version": "v1"}, headers=ADMIN)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "version_in_use" and "'v1'" in error["message"] and "active" in error["message"]
        version, vector = embed(c)
        assert version == "v1" and close_to(vector, v1)

        # Under the canary's string: 409 too, so active and canary stay distinguishable.
        # force: another tiny model is another embedding space, which a canary refuses by default.
        r = c.post("/admin/models/canary", json={"path": str(tiny_model_v2), "version": "c2", "weight": 0.5,
                                                 "force": True}, headers=ADMIN)
        assert r.status_code == 200, r.text
        for body in ({"path": str(tiny_model_v3), "version": "c2"}, {"path": str(tiny_model_v3), "version": "c2",
                                                                     "weight": 0.2}):
            route = "/admin/models/canary" if "weight" in body else "/admin/models/reload"
            r = c.post(route, json=body, headers=ADMIN)
            assert r.status_code == 409 and "'c2'" in r.json()["error"]["message"], r.text
        assert close_to(embed(c, model="c2")[1], v2) and close_to(embed(c, model="v1")[1], v1)
        assert c.post("/admin/models/rollback", headers=ADMIN).status_code == 200

        # SIGHUP with a new model.path and the same model.version: refused, logged, counted as failed.
        failed = reloads(server, "failed")
        write_model(config_dir, {"name": "tiny", "path": str(tiny_model_v3), "version": "v1",
                                 "root": [str(models_root)]})
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: reloads(server, "failed") == failed + 1, what="the refused SIGHUP reload")
        assert "SIGHUP reload failed" in server.log() and "'v1' is already being served" in server.log()
        assert embed(c)[0] == "v1" and close_to(embed(c)[1], v1)

        # Retire v1 for good, then serve v1 again for another model: the cache must not answer with the old.
        r = c.post("/admin/models/reload", json={"path": str(tiny_model_v2), "version": "v2"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        r = c.post("/admin/models/reload", json={"path": str(tiny_model_v3), "version": "v1"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        version, vector = embed(c)
        assert version == "v1" and close_to(vector, v3)
