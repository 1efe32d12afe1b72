"""Model folders that would make a reload run away, and loads an admin abandons (issue 39 items 1 and 9), through
the real admin routes of one real server serving a tiny BERT.

Every load of this server waits model.load_delay_s first (the tests' slow load: the wait a cancel cuts short),
so a change is seen under way before it ends; the tests record the serving version before they act and
assert it after, so they do not depend on their order.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Server, wait_for

ADMIN = {"Authorization": "Bearer folders-admin"}
DELAY_S = 1.5


@pytest.fixture(scope="module")
def server(module_serve: Callable[..., Server], tiny_model: Path, models_root: Path) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__VERSION": "v1", "INFERD__MODEL__NAME": "tiny",
        "INFERD__MODEL__ROOT": str(models_root), "INFERD__SERVER__ADMIN_KEY": "folders-admin",
        "INFERD__MODEL__LOAD_DELAY_S": str(DELAY_S)}, wait="/health/ready", clean_exit=True)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=60) as c:
        yield c


def edited(source: Path, where: Path, **config: Any) -> Path:
    folder = Path(shutil.copytree(source, where, dirs_exist_ok=True))
    (folder / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **config}))
    return folder


def serving(client: httpx.Client) -> str:
    r = client.post("/predict", json={"texts": ["the cat"]})
    assert r.status_code == 200, r.text
    return r.headers["X-Model-Version"]


@pytest.mark.parametrize(("layers", "says"), [
    # The probe's folder: the reload never returned and the process grew past 8 GB.
    (100_000, "config.json's num_hidden_layers is 100000, the checkpoint (model.safetensors) holds 2 layers "
              "(encoder.layer.0-1): the layers it lacks would be built at random"),
    # Item 9: one layer named over two held; transformers dropped the second with a warning.
    (1, "config.json's num_hidden_layers is 1, the checkpoint (model.safetensors) holds 2 layers "
        "(encoder.layer.0-1): the layers past it would be dropped"),
])
def test_a_config_its_checkpoint_contradicts_is_refused_by_the_admin_reload(
        client: httpx.Client, tiny_model: Path, models_root: Path, layers: int, says: str) -> None:
    folder = edited(tiny_model, models_root / f"layers-{layers}", num_hidden_layers=layers)
    before = serving(client)
    r = client.post("/admin/models/reload", json={"path": str(folder), "version": f"layers-{layers}"},
                    headers=ADMIN)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "model_load_failed" and error["param"] == "path"
    assert "reload failed; the serving model is unchanged" in error["message"] and says in error["message"]
    assert serving(client) == before
    # Nothing holds the change lock after the refusal.
    assert client.get("/admin/models", headers=ADMIN).json()["models"][0]["loading"] is None


def test_a_slow_reload_cancelled_leaves_the_serving_model_and_the_next_reload_proceeds(
        client: httpx.Client, tiny_model: Path, tiny_model_v2: Path) -> None:
    before = serving(client)
    target, version = (tiny_model_v2, "v2") if before != "v2" else (tiny_model, "v1-again")
    answer: dict[str, httpx.Response] = {}

    def reload() -> None:
        answer["r"] = client.post("/admin/models/reload", json={"path": str(target), "version": version},
                                  headers=ADMIN)

    thread = threading.Thread(target=reload)
    thread.start()
    loading = wait_for(lambda: client.get("/admin/models", headers=ADMIN).json()["models"][0]["loading"],
                       what="the reload under way")
    assert loading["action"] == "reload" and loading["cancelled"] is False
    # Another change meanwhile is refused, as ever.
    assert client.post("/admin/models/reload", json={"path": str(target), "version": "other"},
                       headers=ADMIN).json()["error"]["code"] == "reload_in_progress"

    cancelled = client.post("/admin/models/reload/cancel", headers=ADMIN)

    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled" and cancelled.json()["action"] == "reload"
    thread.join(30)
    r = answer["r"]
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "load_cancelled"
    assert "reload cancelled; the serving model is unchanged" in r.json()["error"]["message"]
    assert serving(client) == before
    assert client.get("/info").json()["version"] == before
    nothing = client.post("/admin/models/reload/cancel", headers=ADMIN)
    assert nothing.status_code == 409 and nothing.json()["error"]["code"] == "no_load_in_progress"
    # The lock is free: the next reload of the same folder goes through.
    again = client.post("/admin/models/reload", json={"path": str(target), "version": version}, headers=ADMIN)
    assert again.status_code == 200, again.text
    assert serving(client) == version
