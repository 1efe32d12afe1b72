"""Rerank and classification on real server processes, against the reference implementations.

Scores equal ``sentence_transformers.CrossEncoder(path).predict`` and probabilities equal transformers'
text-classification pipeline (≤ 1e-5), on tiny random models saved as real folders; a pair (or text) alone
scores as it does among 32 of mixed lengths; routes of another task answer 404 naming the served one; a
reload to another task is refused (409).
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import Server, metric_value, running
from tinymodel import WORDS, write_tiny_classifier

from .conftest import ADMIN_KEY, task_env

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOL = 1e-5


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def task_root(task_models: Path) -> Path:
    """The package's task models (ce, cls: served by the shared reranker and classifier; ce2) and this suite's
    classifiers, in the folder the shared servers may be reloaded from."""
    write_tiny_classifier(task_models / "cls-multi", seed=6, multi_label=True)
    write_tiny_classifier(task_models / "cls-other", seed=7, labels=("spam", "ham"))
    return task_models


def _cross_encoder(path: Path):  # noqa: ANN202 - sentence_transformers' own type
    from sentence_transformers import CrossEncoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CrossEncoder(str(path), device="cpu")


def test_rerank_scores_equal_the_cross_encoder_including_pairs_past_the_limit(reranker: Server,
                                                                              task_root: Path) -> None:
    rng = random.Random(1)
    query = "which river runs past the city"
    # The model's limit is 64 tokens: the long documents are cut on the document side.
    docs = [_sentence(rng, n) for n in (3, 8, 20, 50, 90, 200)]
    r = httpx.post(reranker.url + "/v1/rerank", json={"query": query, "documents": docs, "return_documents": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = _cross_encoder(task_root / "ce").predict([(query, d) for d in docs])
    got = {item["index"]: item["relevance_score"] for item in body["results"]}
    assert sorted(got) == list(range(len(docs)))
    np.testing.assert_allclose([got[i] for i in range(len(docs))], expected, atol=TOL, rtol=0)
    scores = [item["relevance_score"] for item in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert all(item["document"]["text"] == docs[item["index"]] for item in body["results"])
    assert body["model"] == "all-MiniLM-L6-v2@1" or body["model"].endswith("@1")
    assert body["usage"]["prompt_tokens"] > 0
    exposition = httpx.get(reranker.url + "/metrics").text
    assert metric_value(exposition, "inferd_task_items_total", task="rerank") >= len(docs)


def test_rerank_batch_invariance_one_pair_alone_equals_it_among_32(reranker: Server) -> None:
    rng = random.Random(2)
    query = "a dog in the house"
    docs = [_sentence(rng, rng.randint(1, 80)) for _ in range(32)]
    many = httpx.post(reranker.url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
    by_index = {item["index"]: item["relevance_score"] for item in many["results"]}
    for i in (0, 7, 31):
        alone = httpx.post(reranker.url + "/v1/rerank", json={"query": query, "documents": [docs[i]]},
                           timeout=60).json()
        assert abs(alone["results"][0]["relevance_score"] - by_index[i]) <= TOL


def test_rerank_top_n_and_the_tei_shape(reranker: Server) -> None:
    docs = ["the cat", "a river in the mountain", "hello world", "one two three"]
    full = httpx.post(reranker.url + "/v1/rerank", json={"query": "cat", "documents": docs}).json()["results"]
    top = httpx.post(reranker.url + "/v1/rerank", json={"query": "cat", "documents": docs, "top_n": 2}).json()
    assert top["results"] == full[:2] and "document" not in top["results"][0]
    r = httpx.post(reranker.url + "/rerank", json={"query": "cat", "texts": docs, "return_text": True})
    assert r.status_code == 200, r.text
    tei = r.json()
    assert [t["index"] for t in tei] == [f["index"] for f in full]
    assert all(abs(t["score"] - f["relevance_score"]) <= TOL for t, f in zip(tei, full, strict=True))
    assert all(t["text"] == docs[t["index"]] for t in tei)
    raw = httpx.post(reranker.url + "/rerank", json={"query": "cat", "texts": docs, "raw_scores": True}).json()
    # Sigmoid of the raw logit is the score.
    by_index = {t["index"]: t["score"] for t in tei}
    assert all(abs(1 / (1 + np.exp(-t["score"])) - by_index[t["index"]]) <= TOL for t in raw)


def test_rerank_the_documented_cohere_shape_over_raw_http(reranker: Server) -> None:
    # What the cohere SDK's client.rerank(model=..., query=..., documents=[...], top_n=...) sends (v2 API).
    r = httpx.post(reranker.url + "/v1/rerank", json={"model": None, "query": "hello", "documents": ["hello world",
                   "the dog"], "top_n": 1}, headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) >= {"id", "results", "meta"}
    assert set(body["results"][0]) == {"index", "relevance_score"}


def test_answers_carry_the_request_id_and_return_documents_is_a_strict_boolean(reranker: Server,
                                                                               classifier: Server) -> None:
    body = {"query": "q", "documents": ["a", "b"]}
    for server, path, sent in ((reranker, "/v1/rerank", body), (classifier, "/v1/classify", {"input": "a"})):
        r = httpx.post(server.url + path, json=sent)
        assert r.status_code == 200 and r.json()["id"] == r.headers["x-request-id"] != "", (path, r.text)
        mine = httpx.post(server.url + path, json=sent, headers={"X-Request-Id": "client-7"})
        assert mine.json()["id"] == "client-7"
    for value in ("yes", 1, "true"):
        r = httpx.post(reranker.url + "/v1/rerank", json={**body, "return_documents": value})
        assert r.status_code == 422 and r.json()["error"]["param"] == "return_documents", (value, r.text)
    r = httpx.post(reranker.url + "/v1/rerank", json={**body, "return_documents": None})
    assert r.status_code == 200 and all("document" not in x for x in r.json()["results"]), r.text
    r = httpx.post(reranker.url + "/rerank", json={"query": "q", "texts": ["a"], "return_text": 1})
    assert r.status_code == 422 and r.json()["error"].startswith("return_text: "), r.text  # TEI's shape


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"query": "", "documents": ["a"]}, "query", "empty_string"),
    ({"query": "q", "documents": ["a", "  "]}, "documents[1]", "empty_string"),
    ({"query": 3, "documents": ["a"]}, "query", "invalid_type"),
    ({"query": "q", "documents": ["a"] * 300}, "documents", "too_many_items"),
])
def test_rerank_refusals_name_the_field(reranker: Server, body: dict, param: str, code: str) -> None:
    r = httpx.post(reranker.url + "/v1/rerank", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code)


def test_routes_of_another_task_answer_404_naming_the_served_one(reranker: Server, classifier: Server) -> None:
    r = httpx.post(reranker.url + "/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 404 and "serves the rerank task" in r.json()["error"]["message"]
    r = httpx.post(reranker.url + "/v1/classify", json={"input": "hello"})
    assert r.status_code == 404 and "serves the rerank task" in r.json()["error"]["message"]
    r = httpx.post(classifier.url + "/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 404 and "serves the classification task" in r.json()["error"]["message"]
    info = httpx.get(reranker.url + "/info").json()
    assert info["task"] == "rerank"
    models = httpx.get(classifier.url + "/v1/models").json()
    assert models["data"][0]["task"] == "classification"


def test_classify_probabilities_equal_the_pipeline(classifier: Server, task_root: Path) -> None:
    from transformers import pipeline

    rng = random.Random(3)
    texts = [_sentence(rng, n) for n in (1, 5, 12, 30, 55)]
    r = httpx.post(classifier.url + "/v1/classify", json={"input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    pipe = pipeline("text-classification", model=str(task_root / "cls"), top_k=None, device="cpu")
    labels = ["negative", "neutral", "positive"]
    for item, ref in zip(data, pipe(texts), strict=True):
        expected = {x["label"]: x["score"] for x in ref}
        np.testing.assert_allclose(item["probs"], [expected[label] for label in labels], atol=TOL, rtol=0)
        assert item["label"] == max(expected, key=expected.get) and item["num_classes"] == 3
    one = httpx.post(classifier.url + "/v1/classify", json={"input": texts[2]}).json()["data"]
    assert len(one) == 1 and abs(one[0]["probs"][0] - data[2]["probs"][0]) <= TOL
    pred = httpx.post(classifier.url + "/predict", json={"texts": [texts[2]]}).json()["results"]
    assert pred[0]["label"] == data[2]["label"]


def test_classify_batch_invariance(classifier: Server) -> None:
    rng = random.Random(4)
    texts = [_sentence(rng, rng.randint(1, 60)) for _ in range(32)]
    many = httpx.post(classifier.url + "/v1/classify", json={"input": texts}, timeout=60).json()["data"]
    for i in (0, 13, 31):
        alone = httpx.post(classifier.url + "/v1/classify", json={"input": [texts[i]]}).json()["data"][0]
        np.testing.assert_allclose(alone["probs"], many[i]["probs"], atol=TOL, rtol=0)


def test_multi_label_classifier_uses_sigmoid_as_the_pipeline(task_root: Path,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import pipeline

    with running(tmp_path_factory.mktemp("srv"), task_env(task_root / "cls-multi"), wait="/health/ready") as server:
        texts = ["hello world", "the river runs past the city"]
        data = httpx.post(server.url + "/v1/classify", json={"input": texts}).json()["data"]
        # TEI's /predict holds a client to the model's own activation: sigmoid here, so softmax is refused.
        sigmoid = httpx.post(server.url + "/predict", json={"inputs": texts[0],
                                                            "parameters": {"function_to_apply": "sigmoid"}})
        softmax = httpx.post(server.url + "/predict", json={"inputs": texts[0],
                                                            "parameters": {"function_to_apply": "softmax"}})
    assert sigmoid.status_code == 200, sigmoid.text
    assert softmax.status_code == 422 and "applies sigmoid" in softmax.json()["error"], softmax.text
    pipe = pipeline("text-classification", model=str(task_root / "cls-multi"), top_k=None, device="cpu")
    for item, ref in zip(data, pipe(texts), strict=True):
        expected = {x["label"]: x["score"] for x in ref}
        np.testing.assert_allclose(item["probs"], [expected[k] for k in ("negative", "neutral", "positive")],
                                   atol=TOL, rtol=0)
    assert abs(sum(data[0]["probs"]) - 1.0) > 1e-3  # independent sigmoids, not a softmax


def test_reload_within_a_task_works_and_to_another_task_is_refused(reranker: Server, classifier: Server,
                                                                   task_root: Path) -> None:
    r = httpx.post(reranker.url + "/admin/models/reload",
                   json={"path": str(task_root / "cls"), "version": "x1"}, headers=ADMIN, timeout=60)
    assert r.status_code == 409, r.text
    msg = r.json()["error"]["message"]
    assert "classification model" in msg and "serves the rerank task" in msg
    r = httpx.post(classifier.url + "/admin/models/reload",
                   json={"path": str(task_root / "cls-other"), "version": "x2"}, headers=ADMIN, timeout=60)
    assert r.status_code == 422 and "labels" in r.json()["error"]["message"]
    try:
        r = httpx.post(reranker.url + "/admin/models/reload",
                       json={"path": str(task_root / "ce2"), "version": "2"}, headers=ADMIN, timeout=60)
        assert r.status_code == 200, r.text
        info = httpx.get(reranker.url + "/info").json()
        assert (info["task"], info["version"]) == ("rerank", "2")
    finally:  # the package's reranker serves ce at version 1 to the suites after this one
        back = httpx.post(reranker.url + "/admin/models/reload",
                          json={"path": str(task_root / "ce"), "version": "1"}, headers=ADMIN, timeout=60)
        assert back.status_code == 200, back.text


def test_config_json_written_by_the_fixture_is_a_cross_encoder(task_root: Path) -> None:
    cfg = json.loads((task_root / "ce" / "config.json").read_text())
    assert cfg["architectures"] == ["BertForSequenceClassification"]
    assert cfg["sentence_transformers"]["activation_fn"].endswith("Sigmoid")
