"""Cohere's ``priority`` (0 and up, lower runs first) means the same on every Cohere route: embed (/v1/embed,
/v2/embed) and rerank (/v1/rerank, /v2/rerank) all run it at -priority, and all refuse a negative one (issue 39:
rerank passed it through, so Cohere's priority 10 was refused above batching.max_priority 0 and -3 ran)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import HashHandler, loader_for
from fastapi.testclient import TestClient
from settingskit import make_settings
from tinymodel import write_tiny_cross_encoder

from inferd.api.app import create_app


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    ce = write_tiny_cross_encoder(tmp_path_factory.mktemp("ce") / "ce", seed=3)
    with TestClient(create_app(make_settings(ce, **{"model.name": "ce"}))) as client:
        yield client


@pytest.fixture
def embedder(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(make_settings(tmp_path / "m1"), loader=loader_for(HashHandler()))) as client:
        yield client


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_rerank_runs_cohere_priority_lower_first_as_embed_does(reranker: TestClient, route: str) -> None:
    # batching.max_priority is 0: Cohere's 10 is inferd's -10, always allowed (it was refused as inferd's 10).
    body = {"query": "q", "documents": ["a", "b"]}
    assert reranker.post(route, json={**body, "priority": 10}).status_code == 200
    refused = reranker.post(route, json={**body, "priority": -3})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("route", ["/v1/embed", "/v2/embed"])
def test_embed_runs_cohere_priority_lower_first_and_refuses_negatives(embedder: TestClient, route: str) -> None:
    assert embedder.post(route, json={"texts": ["a"], "priority": 10}).status_code == 200
    refused = embedder.post(route, json={"texts": ["a"], "priority": -3})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "priority"
