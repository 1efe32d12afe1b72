"""Managed platforms on real ``inferd serve`` processes: SageMaker named by ``--platform sagemaker``, Vertex AI
detected from the variables it sets (AIP_HTTP_PORT, AIP_PREDICT_ROUTE, AIP_HEALTH_ROUTE).

A SageMaker-shaped request (``POST /invocations``) and a Vertex-shaped one (``{"instances": [...]}`` on
AIP_PREDICT_ROUTE, an embedding and a rerank instance side by side) each equal the native route's answer; the
platforms' health routes answer readiness; refusals are TEI's; every other route is kept.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from conftest import ROOT, Server, free_port
from tinymodel import write_tiny_bert

TEXTS = ["hello world", "a dog and a cat in the house", "the weather is nice today"]
QUERY = "where is the cat"
DOCS = ["the cat sat on the mat", "dogs bark", "a cat in the house"]
PREDICT = "/v1/endpoints/123/deployedModels/456:predict"
HEALTH = "/v1/endpoints/123/deployedModels/456"
TOL = 1e-5


@pytest.fixture(scope="module")
def servers(task_models: Path, tmp_path_factory: pytest.TempPathFactory,
            module_serve: Callable[..., Server]) -> dict[str, Server]:
    tmp = tmp_path_factory.mktemp("platforms")
    write_tiny_bert(tmp / "emb", seed=41)
    config = tmp / "configs"
    config.mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", config / "base.yaml")
    models = [{"name": "embedder", "path": str(tmp / "emb")}, {"name": "reranker", "path": str(task_models / "ce")}]
    (config / "dev.yaml").write_text(yaml.safe_dump({"models": models}, sort_keys=False))
    common = {"INFERD__MODEL__LOAD_MODE": "eager", "INFERD__CACHE__MAX_ENTRIES": "0"}
    sagemaker = module_serve({**common, "INFERD__MODEL__PATH": str(tmp / "emb")}, args=["--platform", "sagemaker"],
                             wait=None)
    # Vertex AI names the port itself: it wins over the INFERD__SERVER__PORT the suite's helper gives.
    port = free_port()
    vertex = module_serve({**common, "INFERD_CONFIG_DIR": str(config), "AIP_HTTP_PORT": str(port),
                           "AIP_PREDICT_ROUTE": PREDICT, "AIP_HEALTH_ROUTE": HEALTH}, wait=None)
    vertex.url, vertex.port = f"http://127.0.0.1:{port}", port
    for server in (sagemaker, vertex):
        server.wait_ready(120, "/health/ready")
    return {"sagemaker": sagemaker, "vertex": vertex}


def post(server: Server, path: str, body: Any, status: int = 200) -> Any:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def test_sagemaker_invocations_equal_the_native_route_and_ping_is_readiness(servers: dict[str, Server]) -> None:
    server = servers["sagemaker"]
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200
    got = post(server, "/invocations", {"inputs": TEXTS})
    np.testing.assert_allclose(np.array(got), np.array(post(server, "/embed", {"inputs": TEXTS})), atol=TOL)
    native = post(server, "/v1/embeddings", {"input": TEXTS})["data"]  # every other route kept
    np.testing.assert_allclose(np.array(got), np.array([d["embedding"] for d in native]), atol=TOL)
    refused = post(server, "/invocations", {"inputs": []}, status=422)
    assert set(refused) == {"error", "error_type"}


def test_vertex_instances_equal_the_native_routes_in_order(servers: dict[str, Server]) -> None:
    server = servers["vertex"]
    assert httpx.get(server.url + HEALTH, timeout=10).status_code == 200
    got = post(server, PREDICT, {"instances": [{"inputs": TEXTS[0]}, {"query": QUERY, "texts": DOCS},
                                               {"inputs": TEXTS[1:]}]})["predictions"]
    assert len(got) == 3
    np.testing.assert_allclose(got[0], post(server, "/embed", {"inputs": TEXTS[0]}), atol=TOL)
    np.testing.assert_allclose(got[2], post(server, "/embed", {"inputs": TEXTS[1:]}), atol=TOL)
    ranked = post(server, "/rerank", {"query": QUERY, "texts": DOCS})
    assert [r["index"] for r in got[1]] == [r["index"] for r in ranked]
    np.testing.assert_allclose([r["score"] for r in got[1]], [r["score"] for r in ranked], atol=TOL)
    assert post(server, "/predict", {"texts": TEXTS})["model"] == "embedder@1"  # inferd's own /predict kept


def test_vertex_refusals_are_tei_s_and_name_the_instance_field(servers: dict[str, Server]) -> None:
    server = servers["vertex"]
    for body, status, words in [({"instances": []}, 422, "instances"), ({"instance": [{}]}, 422, "instances"),
                                ({"instances": ["text"]}, 422, "instances[0]"),
                                ({"instances": [{"inputs": "ok"}, {"inputs": " "}]}, 422, "inputs")]:
        refused = post(server, PREDICT, body, status=status)
        assert set(refused) == {"error", "error_type"} and words in refused["error"], refused
    r = httpx.post(server.url + PREDICT, content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error_type"] == "validation"
