"""The real ``cohere`` SDK against /v1/rerank (its v1 client) and /v2/rerank (its v2 client) on a real server.

Scores must equal ``sentence_transformers.CrossEncoder(path).predict`` on the same pairs, sorted as Cohere's
API sorts them, with ``top_n`` and ``return_documents`` honoured; a refusal reaches the SDK as its own
exception type with our message.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import cohere
import numpy as np
import pytest
from conftest import Server
from tinymodel import write_tiny_cross_encoder

QUERY = "which river runs past the old city"
DOCS = ["the river runs past the old city walls", "a recipe for bread", "rivers and cities",
        "the city has no river at all, only a lake and a long canal that was dug by hand " * 4,
        "old walls"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_cross_encoder(tmp_path_factory.mktemp("cohere") / "ce", seed=11)


@pytest.fixture(scope="module")
def reranker(cross_encoder: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(cross_encoder), "INFERD__MODEL__NAME": "ce", "INFERD__MODEL__LOAD_MODE": "eager",
        "INFERD__SERVER__API_KEYS": "key-1"}, wait="/health/ready")


@pytest.fixture(scope="module")
def reference(cross_encoder: Path) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = CrossEncoder(str(cross_encoder), device="cpu")
    return np.asarray(model.predict([(QUERY, d) for d in DOCS]), dtype=np.float64)


def test_the_v1_client_reranks_as_the_cross_encoder_scores(reranker: Server, reference: np.ndarray) -> None:
    client = cohere.Client(api_key="key-1", base_url=reranker.url, timeout=30)
    got = client.rerank(model="ce", query=QUERY, documents=DOCS, return_documents=True)
    assert [r.index for r in got.results] == list(np.argsort(-reference, kind="stable"))
    for r in got.results:
        assert abs(r.relevance_score - reference[r.index]) <= 1e-5
        assert r.document is not None and r.document.text == DOCS[r.index]


def test_the_v2_client_with_top_n(reranker: Server, reference: np.ndarray) -> None:
    client = cohere.ClientV2(api_key="key-1", base_url=reranker.url, timeout=30)
    got = client.rerank(model="ce", query=QUERY, documents=DOCS, top_n=2)
    best = list(np.argsort(-reference, kind="stable")[:2])
    assert [r.index for r in got.results] == best
    assert all(abs(r.relevance_score - reference[r.index]) <= 1e-5 for r in got.results)


def test_the_v2_client_priority_runs_lower_first_on_rerank_as_on_embed(reranker: Server) -> None:
    # Cohere's priority 10 (below its default 0) is inferd's -10 on rerank as on embed: the server's
    # batching.max_priority 0 allows it (rerank passed it through as 10 and refused it with 422).
    client = cohere.ClientV2(api_key="key-1", base_url=reranker.url, timeout=30)
    assert len(client.rerank(model="ce", query=QUERY, documents=DOCS, priority=10).results) == len(DOCS)
    with pytest.raises(cohere.errors.UnprocessableEntityError) as caught:
        client.rerank(model="ce", query=QUERY, documents=DOCS, priority=-3)  # Cohere's range is 0 and up
    assert caught.value.body["error"]["param"] == "priority"


def test_a_refusal_reaches_the_sdk_as_its_own_error(reranker: Server) -> None:
    client = cohere.Client(api_key="key-1", base_url=reranker.url, timeout=30)
    with pytest.raises(cohere.errors.UnprocessableEntityError) as caught:
        client.rerank(model="ce", query=QUERY, documents=["fine", ""])
    # Cohere's error shape (id, message), inferd's error object beside it for the route's other clients.
    body = caught.value.body
    assert body["message"].startswith("documents[1]") and body["error"]["param"] == "documents[1]"
    assert body["id"] == caught.value.headers["x-request-id"]
    wrong = cohere.Client(api_key="not-a-key", base_url=reranker.url, timeout=30)
    with pytest.raises(cohere.errors.UnauthorizedError):
        wrong.rerank(model="ce", query=QUERY, documents=DOCS)
