"""Shadow traffic on real servers: the candidate never changes a live answer, adds no 5xx and no refusal, is
shed (and counted) rather than queued past its bound, and its drift report equals an offline computation on the
same texts: the same weights on ONNX Runtime keep the space (cosine > 0.9999, overlap > 0.99) and promote; another
encoder changes it, promotion is refused (and forced), and so is a canary of it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import Server, metric_value, wait_for
from fakes import vector_for

from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec

ADMIN = {"Authorization": "Bearer admin-secret"}
WORDS = ("cat dog house tree river mountain city car run walk read write test data hello world model service "
         "batch queue request response text long short sentence token vector").split()
# 30 requests of 4 texts: 120 texts, more than the default minimum of 100 a verdict needs.
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 6)) + f" {i}" for i in range(120)]


def offline(a: np.ndarray, b: np.ndarray, window: int = 256, k: int = 10) -> dict[str, float]:
    """The report's embedding figures computed the plain way, texts in arrival order."""
    ua = a / np.linalg.norm(a, axis=1, keepdims=True)
    ub = b / np.linalg.norm(b, axis=1, keepdims=True)
    cos = (ua * ub).sum(axis=1)
    overlaps = []
    for i in range(len(a)):
        lo = max(0, i - window)
        if i - lo >= k:
            sa, sb = ua[lo:i] @ ua[i], ub[lo:i] @ ub[i]
            # a neighbour within 1e-5 of the other side's k-th similarity is among its k (float noise, not
            # disagreement); the lower of the two directions
            within = [int((y[np.argsort(-x, kind="stable")[:k]] >= np.sort(y)[::-1][k - 1] - 1e-5).sum())
                      for x, y in ((sa, sb), (sb, sa))]
            overlaps.append(min(within) / k)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()), "overlap_mean": float(np.mean(overlaps))}


def vectors(path: Path, **runtime: str) -> np.ndarray:
    handler = load_handler(ModelSpec(path=path, version="ref", device="cpu", **runtime))
    return np.asarray(handler.postprocess(handler.infer(handler.preprocess(TEXTS))), dtype=np.float64)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shadow-cache")


@pytest.fixture(scope="module")
def server(module_serve: Callable[..., Server], tiny_model: Path, models_root: Path, cache_dir: Path) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__VERSION": "v1", "INFERD__MODEL__NAME": "tiny",
        "INFERD__MODEL__ROOT": str(models_root), "INFERD__SERVER__ADMIN_KEY": "admin-secret",
        "INFERD__MODEL__CACHE_DIR": str(cache_dir), "INFERD__MODEL__LOAD_MODE": "eager"}, wait="/health/ready",
        clean_exit=True)


def ensure_v1(c: httpx.Client, tiny_model: Path) -> None:
    c.delete("/admin/models/shadow", headers=ADMIN)
    c.post("/admin/models/rollback", headers=ADMIN)
    if c.get("/info").json()["version"] != "v1":
        r = c.post("/admin/models/reload", json={"path": str(tiny_model), "version": "v1"}, headers=ADMIN)
        assert r.status_code == 200, r.text


def send_all(c: httpx.Client) -> np.ndarray:
    """TEXTS in requests of four, one after another, each waiting for its shadow copy (arrival order is the
    report's order); returns the live answers."""
    live = []
    for n, k in enumerate(range(0, len(TEXTS), 4)):
        r = c.post("/v1/embeddings", json={"input": TEXTS[k:k + 4]})
        assert r.status_code == 200 and r.headers["X-Model-Version"] == "v1", r.text
        live += [d["embedding"] for d in r.json()["data"]]
        wait_for(lambda n=n: c.get("/admin/models/shadow", headers=ADMIN).json()["report"]["requests"]["computed"]
                 > n, 20, "the shadow copy")
    return np.asarray(live, dtype=np.float64)


def test_the_same_weights_on_onnx_keep_the_space_and_promote(server: Server, tiny_model: Path,
                                                             cache_dir: Path) -> None:
    with server.client() as c:
        ensure_v1(c, tiny_model)
        r = c.post("/admin/models/shadow", json={"path": str(tiny_model), "version": "onnx", "weight": 1.0,
                                                  "backend": "onnx"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        listed = c.get("/admin/models", headers=ADMIN).json()["models"][0]
        assert listed["shadow"]["version"] == "onnx" and listed["shadow"]["weight"] == 1.0
        assert [slot["role"] for slot in listed["slots"]] == ["active"]  # the candidate answers nobody
        live = send_all(c)
        torch_ref = vectors(tiny_model)
        np.testing.assert_allclose(live, torch_ref, atol=1e-5)  # the client got the active model's answers
        want = offline(torch_ref, vectors(tiny_model, backend="onnx", cache_dir=str(cache_dir)))
        state = c.get("/admin/models/shadow", headers=ADMIN).json()
        report = state["report"]
        assert report["items"] == 120 and report["requests"]["shed"] == 0
        for figure in ("cosine_mean", "cosine_min", "overlap_mean"):
            assert report["figures"][figure] == pytest.approx(want[figure], abs=1e-5), figure
        # A tiny random encoder puts many texts at near-equal distances: a 1e-7 difference can swap two
        # neighbours, which the report counts as agreeing (ties within 1e-5), as the offline figure above does.
        assert report["figures"]["cosine_min"] > 0.9999 and report["figures"]["overlap_mean"] > 0.99
        assert all("input" not in item for item in report["most_drifted"])  # no text unless log_inputs
        assert state["verdict"] == {"promote": True, "code": None, "reasons": [], "min_items": 100}
        metrics = c.get("/metrics").text
        assert metric_value(metrics, "inferd_shadow_requests_total", outcome="computed") == 30
        assert metric_value(metrics, "inferd_shadow_cosine_ratio_count") == 120
        # Shadow batches stay out of the live figures.
        assert metric_value(metrics, "inferd_batch_size_count", version="onnx") == 0
        promoted = c.post("/admin/models/shadow/promote", headers=ADMIN)
        assert promoted.status_code == 200, promoted.text
        assert c.get("/info").json()["version"] == "onnx"
        assert c.get("/admin/models/shadow", headers=ADMIN).status_code == 404
        assert c.get("/admin/models", headers=ADMIN).json()["models"][0]["shadow"] is None
        ensure_v1(c, tiny_model)


def test_another_encoder_changes_the_space_and_promotion_is_refused_unless_forced(
        server: Server, tiny_model: Path, tiny_model_v2: Path) -> None:
    with server.client() as c:
        ensure_v1(c, tiny_model)
        canary = c.post("/admin/models/canary", json={"path": str(tiny_model_v2), "version": "v2", "weight": 0.5},
                        headers=ADMIN)
        assert canary.status_code == 409, canary.text
        err = canary.json()["error"]
        assert err["code"] == "space_changed" and "shadow" in err["message"] and "int8_cosine_min" in err["message"]
        r = c.post("/admin/models/shadow", json={"path": str(tiny_model_v2), "version": "v2", "weight": 1.0},
                   headers=ADMIN)
        assert r.status_code == 200, r.text
        early = c.post("/admin/models/shadow/promote", headers=ADMIN)
        assert early.status_code == 409 and early.json()["error"]["code"] == "shadow_insufficient"
        live = send_all(c)
        np.testing.assert_allclose(live, vectors(tiny_model), atol=1e-5)
        want = offline(vectors(tiny_model), vectors(tiny_model_v2))
        report = c.get("/admin/models/shadow", headers=ADMIN).json()["report"]
        for figure in ("cosine_mean", "cosine_min", "overlap_mean"):
            assert report["figures"][figure] == pytest.approx(want[figure], abs=1e-5), figure
        refused = c.post("/admin/models/shadow/promote", headers=ADMIN)
        assert refused.status_code == 409
        err = refused.json()["error"]
        assert err["code"] == "shadow_drifted" and "model.gate.int8_cosine_mean" in err["message"]
        assert c.get("/info").json()["version"] == "v1"
        forced = c.post("/admin/models/shadow/promote", params={"force": "true"}, headers=ADMIN)
        assert forced.status_code == 200, forced.text
        assert c.get("/info").json()["version"] == "v2"
        ensure_v1(c, tiny_model)
        forced_canary = c.post("/admin/models/canary", json={"path": str(tiny_model_v2), "version": "v2",
                                                             "weight": 0.5, "force": True}, headers=ADMIN)
        assert forced_canary.status_code == 200, forced_canary.text
        ensure_v1(c, tiny_model)


def test_shadow_admin_errors_are_in_the_one_shape(server: Server, tiny_model: Path) -> None:
    with server.client() as c:
        ensure_v1(c, tiny_model)
        for method, path in (("GET", "/admin/models/shadow"), ("DELETE", "/admin/models/shadow"),
                             ("POST", "/admin/models/shadow/promote")):
            r = c.request(method, path, headers=ADMIN)
            assert r.status_code in (404, 409) and r.json()["error"]["code"] == "no_shadow", (method, r.text)
        bad = c.post("/admin/models/shadow", json={"path": str(tiny_model), "version": "x", "weight": 2},
                     headers=ADMIN)
        assert bad.status_code == 422 and "error" in bad.json()
        outside = c.post("/admin/models/shadow", json={"path": "/etc", "version": "x", "weight": 0.5}, headers=ADMIN)
        assert outside.status_code == 422 and "error" in outside.json()
        same = c.post("/admin/models/shadow", json={"path": str(tiny_model), "version": "v1", "weight": 0.5},
                      headers=ADMIN)
        assert same.status_code == 409 and same.json()["error"]["code"] == "version_in_use"


# -- under load, on the fake handler ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> tuple[Server, Path]:
    tmp = tmp_path_factory.mktemp("shadow-fake")
    for name in ("gates", "model", "candidate"):
        (tmp / name).mkdir()
    server = module_serve({
        "INFERD__MODEL__TASK": "fakes:HashHandler", "INFERD__MODEL__PATH": str(tmp / "model"),
        "INFERD__MODEL__ROOT": str(tmp), "INFERD__SERVER__ADMIN_KEY": "admin-secret",
        "INFERD__BATCHING__MAX_BATCH_SIZE": "8", "INFERD__BATCHING__MAX_QUEUE": "512",
        "INFERD__LIMITS__MAX_ITEMS_PER_REQUEST": "300", "INFERD__BATCHING__MIN_PADDING_EFFICIENCY": "0",
        "FAKE_GATE_DIR": str(tmp / "gates")}, wait="/health/ready", clean_exit=True)
    return server, tmp


def totals(text: str, name: str, **labels: str) -> float:
    try:
        return metric_value(text, name, **labels)
    except (AssertionError, KeyError, ValueError):
        return 0.0


def test_under_load_shadow_changes_no_answer_adds_no_error_and_sheds_what_does_not_fit(
        fake: tuple[Server, Path]) -> None:
    server, tmp = fake
    with server.client() as c:
        r = c.post("/admin/models/shadow", json={"path": str(tmp / "candidate"), "version": "c", "weight": 1.0},
                   headers=ADMIN)
        assert r.status_code == 200, r.text
        before = c.get("/metrics").text

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as ac:
            gate = uuid.uuid4().hex
            held = asyncio.ensure_future(ac.post("/predict", json={"texts": [f"hold:{gate}"]}))
            await asyncio.sleep(0.3)  # the worker is held: everything below queues behind it
            burst = [asyncio.ensure_future(ac.post("/predict", json={"texts": [f"t{i}-{j}" for j in range(5)]}))
                     for i in range(40)]
            # Its mirror needs 300 places; the shadow lane holds 256: shed, never a refusal.
            big = asyncio.ensure_future(ac.post("/predict", json={"texts": [f"big {i}" for i in range(300)]}))
            await asyncio.sleep(0.3)
            (tmp / "gates" / gate).touch()
            return await asyncio.gather(held, *burst, big)

    answers = asyncio.run(load())
    assert [a.status_code for a in answers] == [200] * len(answers)
    for i, a in enumerate(answers[1:41]):
        assert a.json()["results"] == [vector_for(f"t{i}-{j}") for j in range(5)]
    with server.client() as c:
        state: dict[str, Any] = {}

        def settled() -> bool:
            state.update(c.get("/admin/models/shadow", headers=ADMIN).json())
            req = state["report"]["requests"]
            return req["computed"] + req["shed"] + req["failed"] == req["sampled"] == 42

        wait_for(settled, 20, "every mirrored request to be computed or shed")
        assert state["report"]["requests"]["shed"] >= 1 and state["report"]["requests"]["failed"] == 0
        assert state["report"]["figures"]["cosine_min"] == pytest.approx(1.0)  # the same handler: the same space
        after = c.get("/metrics").text
        for reason in ("overloaded", "deadline", "draining"):
            assert totals(after, "inferd_requests_rejected_total", reason=reason) == totals(
                before, "inferd_requests_rejected_total", reason=reason)
        assert totals(after, "inferd_shadow_requests_total", outcome="shed") >= 1
        dropped = c.delete("/admin/models/shadow", headers=ADMIN)
        assert dropped.status_code == 200 and dropped.json()["report"]["requests"]["sampled"] == 42


# -- rerank and classification, on a server of several models ---------------------------------------------

QUERIES = [" ".join(WORDS[(q * 5 + j) % len(WORDS)] for j in range(3)) for q in range(10)]
DOCS = [[" ".join(WORDS[(q * 3 + d * 7 + j) % len(WORDS)] for j in range(4 + d % 3)) for d in range(8)]
        for q in range(10)]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> tuple[Server, Path]:
    import shutil

    import yaml
    from conftest import ROOT
    from tinymodel import write_tiny_classifier, write_tiny_cross_encoder

    root = tmp_path_factory.mktemp("shadow-pipeline")
    write_tiny_cross_encoder(root / "ce", seed=13)
    write_tiny_cross_encoder(root / "ce2", seed=14)
    write_tiny_classifier(root / "cls", seed=15)
    write_tiny_classifier(root / "cls2", seed=16)
    config = root / "configs"
    config.mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", config / "base.yaml")
    models = [{"name": "reranker", "path": str(root / "ce")}, {"name": "classifier", "path": str(root / "cls")}]
    (config / "dev.yaml").write_text(yaml.safe_dump({"models": models, "model": {"root": [str(root)]}}))
    server = module_serve({"INFERD_CONFIG_DIR": str(config), "INFERD__SERVER__ADMIN_KEY": "admin-secret",
                           "INFERD__MODEL__LOAD_MODE": "eager"}, wait="/health/ready", clean_exit=True)
    return server, root


def outputs(path: Path, inputs: list[Any]) -> np.ndarray:
    handler = load_handler(ModelSpec(path=path, version="ref", device="cpu"))
    return np.asarray(handler.postprocess(handler.infer(handler.preprocess(inputs))), dtype=np.float64)


def computed(c: httpx.Client, model: str) -> int:
    return c.get("/admin/models/shadow", params={"model": model}, headers=ADMIN).json()["report"]["requests"][
        "computed"]


def test_rerank_and_classification_reports_equal_an_offline_computation(pipeline: tuple[Server, Path]) -> None:
    from inferd.core.agreement import spearman, top_agreement

    server, root = pipeline
    with server.client() as c:
        unnamed = c.post("/admin/models/shadow", json={"path": str(root / "ce2"), "version": "2", "weight": 1.0},
                         headers=ADMIN)
        assert unnamed.status_code == 422 and unnamed.json()["error"]["code"] == "model_required"
        for model, folder in (("reranker", "ce2"), ("classifier", "cls2")):
            r = c.post("/admin/models/shadow", json={"model": model, "path": str(root / folder), "version": "2",
                                                      "weight": 1.0}, headers=ADMIN)
            assert r.status_code == 200, r.text
        for n, (query, docs) in enumerate(zip(QUERIES, DOCS, strict=True)):
            r = c.post("/v1/rerank", json={"model": "reranker", "query": query, "documents": docs})
            assert r.status_code == 200 and r.json()["model"] == "reranker@1", r.text
            wait_for(lambda n=n: computed(c, "reranker") > n, 20, "the rerank shadow copy")
        texts = [d for docs in DOCS for d in docs]
        for n, k in enumerate(range(0, len(texts), 8)):
            r = c.post("/v1/classify", json={"model": "classifier", "input": texts[k:k + 8]})
            assert r.status_code == 200, r.text
            wait_for(lambda n=n: computed(c, "classifier") > n, 20, "the classification shadow copy")
        rerank = c.get("/admin/models/shadow", params={"model": "reranker"}, headers=ADMIN).json()["report"]
        labels = c.get("/admin/models/shadow", params={"model": "classifier"}, headers=ADMIN).json()["report"]

    spearmans, tops = [], []
    for query, docs in zip(QUERIES, DOCS, strict=True):
        pairs = [(query, d) for d in docs]
        a, b = outputs(root / "ce", pairs)[:, 0], outputs(root / "ce2", pairs)[:, 0]
        spearmans.append(spearman(a, b))
        tops.append(top_agreement(a, b))
    assert rerank["items"] == 80 and rerank["requests"]["computed"] == 10
    assert rerank["spearman"]["mean"] == pytest.approx(np.mean(spearmans), abs=1e-5)
    assert rerank["top3_agreement"]["mean"] == pytest.approx(np.mean(tops), abs=1e-5)

    pa, pb = outputs(root / "cls", texts), outputs(root / "cls2", texts)
    assert labels["items"] == 80
    assert labels["label_agreement"]["mean"] == pytest.approx(float((pa.argmax(1) == pb.argmax(1)).mean()), abs=1e-6)
    assert labels["probability_delta"]["max"] == pytest.approx(float(np.abs(pa - pb).max()), abs=1e-5)
    assert sum(cell["count"] for cell in labels["confusion"]) == 80
