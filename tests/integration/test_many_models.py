"""Several models in one server process: two embedders, a reranker and a classifier, on a real server.

Each route with each model answers as a server of that model alone; the request's ``model`` picks the model
(its task's default when omitted; TEI's /predict, which names none, the classifier's for texts and the
reranker's for pairs); names not served, and models of another task, are refused 404
``model_not_found``; a reload of one model under load on two leaves both at 0 non-2xx; one model failing to
load leaves the others serving and readiness says which; SIGHUP adds, removes and changes models; a flooded
model cannot hold another's request behind its backlog; the openai and cohere SDKs reach models by name.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import openai
import pytest
import yaml
from conftest import ROOT, Server, metric_value, wait_for
from enginekit import until
from fakes import read_record
from tinymodel import write_tiny_bert

ADMIN = {"Authorization": "Bearer admin-secret"}
TEXTS = ["hello world", "a dog and a cat in the house", "the weather is nice today", "一个 测试"]
QUERY = "where is the cat"
DOCS = ["the cat sat on the mat", "dogs bark", "a cat in the house", "the weather"]
TOL = 1e-5


def write_config(folder: Path, models: list[dict[str, Any]], **sections: Any) -> Path:
    """A config folder: the project's base.yaml and a dev.yaml holding ``models`` (and other sections)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "configs" / "base.yaml", folder / "base.yaml")
    (folder / "dev.yaml").write_text(yaml.safe_dump({"models": models, **sections}, sort_keys=False))
    return folder


def config_env(tmp: Path, models: list[dict[str, Any]], **env: str) -> dict[str, str]:
    config = write_config(tmp / f"configs-{uuid.uuid4().hex[:6]}", models)
    return {"INFERD_CONFIG_DIR": str(config), "INFERD__SERVER__ADMIN_KEY": "admin-secret",
            "INFERD__MODEL__LOAD_MODE": "eager", **env}


@pytest.fixture(scope="module")
def root(task_models: Path) -> Path:
    """The package's task models (ce, ce2, cls: the shared reranker and classifier serve ce and cls alone) and
    this suite's two embedders beside them."""
    write_tiny_bert(task_models / "emb-a", seed=11)
    write_tiny_bert(task_models / "emb-b", seed=12, pooling="cls")
    return task_models


def pipeline_models(root: Path) -> list[dict[str, Any]]:
    return [{"name": "embedder", "path": str(root / "emb-a")},
            {"name": "embedder-b", "path": str(root / "emb-b")},
            {"name": "reranker", "path": str(root / "ce"), "batching": {"max_batch_size": 8}},
            {"name": "classifier", "path": str(root / "cls")}]


@pytest.fixture(scope="module")
def pipeline(root: Path, tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    return module_serve(config_env(tmp_path_factory.mktemp("pipeline"), pipeline_models(root)), wait="/health/ready")


@pytest.fixture(scope="module")
def singles(root: Path, module_serve: Callable[..., Server], reranker: Server,
            classifier: Server) -> dict[str, Server]:
    """One server per model, as a user would run them without the list: the reference answers. The reranker and
    the classifier are the package's (the same folders); the embedders start side by side (each start is mostly
    imports), then each is waited for."""
    started = {name: module_serve({"INFERD__MODEL__PATH": str(root / folder), "INFERD__MODEL__LOAD_MODE": "eager"},
                                  wait=None) for name, folder in (("embedder", "emb-a"), ("embedder-b", "emb-b"))}
    for server in started.values():
        server.wait_ready(120, "/health/ready")
    return {**started, "reranker": reranker, "classifier": classifier}


def post(server: Server, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def embeddings(server: Server, model: str | None) -> np.ndarray:
    body = post(server, "/v1/embeddings", {"input": TEXTS, **({"model": model} if model else {})})
    return np.array([d["embedding"] for d in body["data"]])


def test_each_route_with_each_model_answers_as_that_model_alone(pipeline: Server,
                                                                  singles: dict[str, Server]) -> None:
    for name in ("embedder", "embedder-b"):
        alone = embeddings(singles[name], None)
        np.testing.assert_allclose(embeddings(pipeline, name), alone, atol=TOL)
        predicted = post(pipeline, "/predict", {"texts": TEXTS, "model": name})
        assert predicted["model"] == f"{name}@1"
        np.testing.assert_allclose(np.array(predicted["results"]), alone, atol=TOL)
    a, b = embeddings(pipeline, "embedder"), embeddings(pipeline, "embedder-b")
    assert not np.allclose(a, b, atol=1e-2)  # two different models, really routed apart

    rerank_alone = post(singles["reranker"], "/v1/rerank", {"query": QUERY, "documents": DOCS})["results"]
    for path in ("/v1/rerank", "/v2/rerank"):
        got = post(pipeline, path, {"query": QUERY, "documents": DOCS, "model": "reranker"})
        assert got["model"] == "reranker@1"
        assert [r["index"] for r in got["results"]] == [r["index"] for r in rerank_alone]
        np.testing.assert_allclose([r["relevance_score"] for r in got["results"]],
                                   [r["relevance_score"] for r in rerank_alone], atol=TOL)
    tei = post(pipeline, "/rerank", {"query": QUERY, "texts": DOCS, "model": "reranker"})
    assert [r["index"] for r in tei] == [r["index"] for r in rerank_alone]
    pairs = post(pipeline, "/predict", {"texts": [[QUERY, d] for d in DOCS], "model": "reranker"})["results"]
    pairs_alone = post(singles["reranker"], "/predict", {"texts": [[QUERY, d] for d in DOCS]})["results"]
    np.testing.assert_allclose(pairs, pairs_alone, atol=TOL)

    cls_alone = post(singles["classifier"], "/v1/classify", {"input": TEXTS})["data"]
    got = post(pipeline, "/v1/classify", {"input": TEXTS, "model": "classifier"})["data"]
    assert [d["label"] for d in got] == [d["label"] for d in cls_alone]
    np.testing.assert_allclose([d["probs"] for d in got], [d["probs"] for d in cls_alone], atol=TOL)
    predicted = post(pipeline, "/predict", {"texts": TEXTS, "model": "classifier"})["results"]
    assert [p["label"] for p in predicted] == [d["label"] for d in cls_alone]


def test_a_request_without_a_model_gets_its_tasks_default(pipeline: Server) -> None:
    assert post(pipeline, "/v1/embeddings", {"input": "hi"})["model"] == "embedder@1"  # the first embedder
    assert post(pipeline, "/v1/rerank", {"query": QUERY, "documents": DOCS})["model"] == "reranker@1"
    assert post(pipeline, "/v1/classify", {"input": "hi"})["model"] == "classifier@1"
    assert post(pipeline, "/predict", {"texts": ["hi"]})["model"] == "embedder@1"  # the server's default
    assert post(pipeline, "/v1/embeddings", {"input": "hi", "model": "embedder@1"})["model"] == "embedder@1"
    # TEI's routes name no model: its /predict runs the classifier default for texts, the reranker's for pairs.
    cls = post(pipeline, "/v1/classify", {"input": TEXTS})["data"]
    labels = post(pipeline, "/predict", {"inputs": [[t] for t in TEXTS]})
    assert [row[0]["label"] for row in labels] == [d["label"] for d in cls]
    np.testing.assert_allclose([max(x["score"] for x in row) for row in labels], [max(d["probs"]) for d in cls],
                               atol=TOL)
    ranked = {r["index"]: r["relevance_score"]
              for r in post(pipeline, "/v1/rerank", {"query": QUERY, "documents": DOCS})["results"]}
    scored = post(pipeline, "/predict", {"inputs": [[QUERY, d] for d in DOCS]})
    np.testing.assert_allclose([row[0]["score"] for row in scored], [ranked[i] for i in range(len(DOCS))],
                               atol=TOL)
    assert [r["index"] for r in post(pipeline, "/rerank", {"query": QUERY, "texts": DOCS})] == sorted(
        ranked, key=lambda i: -ranked[i])


@pytest.mark.parametrize(("path", "body", "named"), [
    ("/v1/embeddings", {"input": "hi", "model": "text-embedding-3-small"}, "embedder, embedder-b"),
    ("/v1/embeddings", {"input": "hi", "model": "reranker"}, "embedder, embedder-b"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "model": "embedder"}, "reranker"),
    ("/v1/classify", {"input": "hi", "model": "reranker"}, "classifier"),
    ("/predict", {"texts": ["hi"], "model": "nope"}, "embedder (embedding)"),
    ("/v1/embeddings", {"input": "hi", "model": "embedder@9"}, None),
])
def test_unknown_and_wrong_task_models_are_refused_naming_the_served_ones(
        pipeline: Server, path: str, body: dict[str, Any], named: str | None) -> None:
    err = post(pipeline, path, body, 404)["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model", err
    if named is not None:
        assert named in err["message"] and repr(body["model"]) in err["message"]


def test_v1_models_and_info_list_every_model_with_its_task_and_readiness(pipeline: Server) -> None:
    listed = httpx.get(pipeline.url + "/v1/models").json()["data"]
    assert [(m["id"], m["task"], m["ready"]) for m in listed] == [
        ("embedder", "embedding", True), ("embedder-b", "embedding", True), ("reranker", "rerank", True),
        ("classifier", "classification", True)]
    assert all(m["versions"][0]["version"] == "1" and m["backend"] == "torch" for m in listed)
    info = httpx.get(pipeline.url + "/info").json()
    assert [m["name"] for m in info["models"]] == ["embedder", "embedder-b", "reranker", "classifier"]
    assert info["name"] == "embedder" and info["task"] == "embedding"
    ready = httpx.get(pipeline.url + "/health/ready").json()
    assert ready["status"] == "ready" and set(ready["models"].values()) == {"ready"}
    assert httpx.get(pipeline.url + "/health/ready", params={"model": "reranker"}).json()["model"] == "reranker"
    missing = httpx.get(pipeline.url + "/health/ready", params={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_every_stage_metric_carries_the_model(pipeline: Server) -> None:
    post(pipeline, "/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "reranker"})
    post(pipeline, "/v1/embeddings", {"input": TEXTS, "model": "embedder-b"})
    text = httpx.get(pipeline.url + "/metrics").text
    for model, task in (("reranker", "rerank"), ("embedder-b", "embedding")):
        for name in ("inferd_batch_size_count", "inferd_inference_duration_seconds_count",
                     "inferd_queue_duration_seconds_count", "inferd_preprocess_duration_seconds_count",
                     "inferd_version_requests_total"):
            assert metric_value(text, name, model=model, version="1") > 0, (name, model)
        assert metric_value(text, "inferd_task_items_total", model=model, task=task) > 0
        assert metric_value(text, "inferd_queue_depth", model=model) == 0
        assert metric_value(text, "inferd_model_info", model=model, slot="active", version="1", task=task,
                            device="cpu", dtype="float32", backend="torch", quantize="none") == 1
    assert metric_value(text, "inferd_requests_total", endpoint="/v1/rerank", status="200", model="reranker") >= 1


def test_a_reload_of_one_model_under_load_on_two_loses_nothing(root: Path, tmp_path: Path,
                                                                 serve: Callable[..., Server]) -> None:
    server = serve(config_env(tmp_path, pipeline_models(root)[::2]), wait="/health/ready")  # embedder, reranker

    async def load(stop: asyncio.Event) -> list[tuple[str, int, str]]:
        seen: list[tuple[str, int, str]] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            async def embedder() -> None:
                while not stop.is_set():
                    r = await c.post("/v1/embeddings", json={"input": TEXTS, "model": "embedder"})
                    seen.append(("embedder", r.status_code, r.json().get("model", "")))

            async def reranker() -> None:
                while not stop.is_set():
                    r = await c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "model": "reranker"})
                    seen.append(("reranker", r.status_code, r.json().get("model", "")))

            tasks = [asyncio.create_task(f()) for f in (embedder, embedder, reranker, reranker)]
            await asyncio.sleep(0.5)
            r = await c.post("/admin/models/reload", headers=ADMIN, timeout=120,
                             json={"model": "reranker", "path": str(root / "ce2"), "version": "2"})
            assert r.status_code == 200, r.text
            assert r.json()["active"]["model"] == "reranker"
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
        return seen

    seen = asyncio.run(load(asyncio.Event()))
    assert [s for s in seen if s[1] != 200] == []
    assert {m for who, _, m in seen if who == "reranker"} == {"reranker@1", "reranker@2"}
    assert {m for who, _, m in seen if who == "embedder"} == {"embedder@1"}  # the other model untouched
    # The reload named its model: a change without a name is refused when several are served.
    r = httpx.post(server.url + "/admin/models/rollback", headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "model_required"
    r = httpx.post(server.url + "/admin/models/rollback", headers=ADMIN, params={"model": "reranker"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_canary"


def test_a_model_that_fails_to_load_leaves_the_others_serving_and_sighup_changes_the_list(
        root: Path, tmp_path: Path, serve: Callable[..., Server]) -> None:
    tmp = tmp_path
    (tmp / "broken").mkdir()
    (tmp / "broken" / "config.json").write_text("{not json")
    models = [{"name": "embedder", "path": str(root / "emb-a")}, {"name": "broken", "path": str(tmp / "broken")}]
    server = serve(config_env(tmp, models, INFERD__MODEL__LOAD_MODE="background"), wait="/health/live")
    config = Path(server.env["INFERD_CONFIG_DIR"]) / "dev.yaml"
    wait_for(lambda: httpx.get(server.url + "/v1/models").json()["data"][1]["state"] == "failed",
             what="the broken model's load to fail")
    ready = httpx.get(server.url + "/health/ready")
    assert ready.status_code == 503 and ready.headers["Retry-After"]
    assert ready.json()["status"] == "failed" and ready.json()["models"] == {"embedder": "ready",
                                                                             "broken": "failed"}
    assert httpx.get(server.url + "/health/ready", params={"model": "embedder"}).status_code == 200
    assert post(server, "/v1/embeddings", {"input": "hi", "model": "embedder"})["model"] == "embedder@1"
    refused = post(server, "/v1/embeddings", {"input": "hi", "model": "broken"}, 503)["error"]
    assert refused["code"] == "model_failed" and "'broken'" in refused["message"]

    # Not required: readiness no longer waits for it (SIGHUP takes the new rule without a reload).
    config.write_text(yaml.safe_dump({"models": [models[0], {**models[1], "required": False}]}))
    server.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: httpx.get(server.url + "/health/ready").status_code == 200, what="readiness")

    # SIGHUP again: the broken one removed, a reranker added (loaded), the embedder untouched.
    config.write_text(yaml.safe_dump({"models": [models[0], {"name": "reranker", "path": str(root / "ce")}]}))
    server.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
             == ["embedder", "reranker"] and httpx.get(server.url + "/health/ready").status_code == 200,
             what="the new list served")
    assert post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS})["model"] == "reranker@1"
    gone = post(server, "/v1/embeddings", {"input": "hi", "model": "broken"}, 404)["error"]
    assert gone["code"] == "model_not_found"
    assert "SIGHUP: broken removed, embedder unchanged, reranker added" in server.log()


def test_a_flooded_model_cannot_hold_another_models_request_behind_its_backlog(
        tmp_path: Path, serve: Callable[..., Server]) -> None:
    """Models run on instances of their own (core/instances.py), shown without a clock: model a's batch is held
    while 20 more batches of it queue, then one text of model b is sent; b's answer comes while a's batch is still
    held, before any of a's backlog has run (one shared worker ran it after the held batch at best)."""
    tmp = tmp_path
    for name in ("a", "b", "gates"):
        (tmp / name).mkdir()
    record = tmp / "record.jsonl"
    lane = {"task": "fakes:HashHandler", "batching": {"max_batch_size": 8, "max_queue": 512, "max_wait_ms": 0,
                                                     "min_padding_efficiency": 0}}
    server = serve(config_env(tmp, [{"name": "a", "path": str(tmp / "a"), **lane},
                                    {"name": "b", "path": str(tmp / "b"), **lane}],
                              FAKE_RECORD=str(record), FAKE_GATE_DIR=str(tmp / "gates")), wait="/health/ready")
    async def scenario() -> list[int]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            hold = asyncio.ensure_future(c.post("/predict", json={"texts": ["hold:gate"], "model": "a"}))
            await until(lambda: any("hold:gate" in b for b in read_record(record)), 30, "the held batch", every=0.02)
            flood = [asyncio.ensure_future(c.post("/predict", json={
                "texts": [f"a-{i}-{j}" for j in range(8)], "model": "a"})) for i in range(20)]

            async def a_queued() -> bool:
                return metric_value((await c.get("/metrics")).text, "inferd_queue_depth", model="a") == 160

            await until(a_queued, 30, "160 queued texts of a", every=0.02)
            other = await c.post("/predict", json={"texts": ["b-0"], "model": "b"})
            assert other.status_code == 200 and not hold.done()
            (tmp / "gates" / "gate").touch()
            answers = await asyncio.gather(hold, *flood)
            return [r.status_code for r in [other, *answers]]

    assert set(asyncio.run(asyncio.wait_for(scenario(), 90))) == {200}
    batches = read_record(record)
    held = next(i for i, b in enumerate(batches) if "hold:gate" in b)
    assert sum(len(b) for b in batches[held + 1:]) == 161  # nothing lost
    first_of_a = next(i for i, b in enumerate(batches) if any(t.startswith("a-") for t in b))
    assert next(i for i, b in enumerate(batches) if "b-0" in b) < first_of_a


def test_the_openai_and_cohere_sdks_reach_models_by_name_in_one_process(pipeline: Server,
                                                                          singles: dict[str, Server]) -> None:
    client = openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)
    for name in ("embedder", "embedder-b"):
        got = client.embeddings.create(model=name, input=TEXTS)
        assert got.model == f"{name}@1"
        np.testing.assert_allclose([d.embedding for d in got.data], embeddings(singles[name], None), atol=TOL)
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="text-embedding-3-small", input=["hi"])
    assert "embedder, embedder-b" in str(missing.value)

    co = cohere.ClientV2(api_key="unused", base_url=pipeline.url, timeout=30)
    ranked = co.rerank(model="reranker", query=QUERY, documents=DOCS, top_n=2)
    alone = post(singles["reranker"], "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})["results"]
    assert [r.index for r in ranked.results] == [r["index"] for r in alone]
    np.testing.assert_allclose([r.relevance_score for r in ranked.results], [r["relevance_score"] for r in alone],
                               atol=TOL)
    with pytest.raises(cohere.core.api_error.ApiError) as wrong:
        co.rerank(model="embedder", query=QUERY, documents=DOCS)
    assert wrong.value.status_code == 404


def test_the_list_is_validated_naming_the_model_and_the_key(tmp_path: Path) -> None:
    from inferd.config import ConfigError, load_settings

    config = write_config(tmp_path / "c", [{"name": "ok", "path": "/m"}, {"name": "bad", "dtype": "float8"}])
    with pytest.raises(ConfigError) as caught:
        load_settings(config_dir=config, environ={})
    assert "models.bad.dtype" in str(caught.value) and str(config / "dev.yaml") in str(caught.value)
    config = write_config(tmp_path / "d", [{"name": "Same"}, {"name": "same"}])
    with pytest.raises(ConfigError, match="'Same' and 'same'"):
        load_settings(config_dir=config, environ={})
    config = write_config(tmp_path / "e", [{"name": "has space"}])
    with pytest.raises(ConfigError, match="models.has space.name"):
        load_settings(config_dir=config, environ={})
    config = write_config(tmp_path / "f", [{"name": "a", "path": "/m"}, {"name": "b-2", "path": "/n"}])
    s = load_settings(config_dir=config, environ={"INFERD__MODELS__B_2__BACKEND": "onnx",
                                                  "INFERD__MODELS__B_2__BATCHING__MAX_BATCH_SIZE": "4",
                                                  "INFERD__BATCHING__MAX_WAIT_MS": "7"})
    a, b = s.served()
    assert (a.model.backend, b.model.backend, a.batching.max_batch_size, b.batching.max_batch_size) == (
        "torch", "onnx", 32, 4)
    assert a.batching.max_wait_ms == b.batching.max_wait_ms == 7  # the shared section is every model's default
    with pytest.raises(ConfigError, match="INFERD__MODELS__C__DTYPE: names no configured model"):
        load_settings(config_dir=config, environ={"INFERD__MODELS__C__DTYPE": "float32"})
    assert json.loads(json.dumps([e.name for e in s.served()])) == ["a", "b-2"]
