"""api/platforms.py in-process (the app with the fake HashHandler): which routes each platform adds, that a Vertex
predict route on one of inferd's own paths answers as Vertex's, and that each is a metric label of its own. Real
servers started with --platform and the platforms' variables are tests/integration/test_platforms.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fakes import HashHandler, loader_for
from fastapi.testclient import TestClient
from settingskit import make_settings

from inferd.api.app import create_app, route_paths


def client(tmp_path: Path, **server: Any) -> TestClient:
    settings = make_settings(tmp_path / "m1", model={"version": "v1"}, server=server)
    return TestClient(create_app(settings, loader=loader_for(HashHandler())))


def test_without_a_platform_none_of_its_routes_exist(tmp_path: Path) -> None:
    with client(tmp_path) as c:
        assert c.get("/ping").status_code == 404
        assert c.post("/invocations", json={"inputs": "a"}).status_code == 404
        assert c.post("/vertex", json={"instances": [{"inputs": "a"}]}).status_code == 404


def test_sagemaker_adds_ping_and_invocations_as_labels_of_their_own(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "m1", server={"platform": "sagemaker"})
    assert {"/ping", "/invocations"} <= route_paths(settings)
    with client(tmp_path, platform="sagemaker") as c:
        assert c.get("/ping").status_code == 200
        assert c.post("/invocations", json={"inputs": ["a", "b"]}).json() == c.post(
            "/embed", json={"inputs": ["a", "b"]}).json()
        assert c.post("/vertex", json={"instances": [{"inputs": "a"}]}).status_code == 404


def test_a_vertex_predict_route_on_inferds_own_path_answers_as_vertexs(tmp_path: Path) -> None:
    with client(tmp_path, platform="vertex", platform_predict_route="/predict",
                platform_health_route="/v1/endpoints/1/deployedModels/2") as c:
        got = c.post("/predict", json={"instances": [{"inputs": "a"}, {"inputs": ["b", "c"]}]})
        assert got.status_code == 200, got.text
        assert got.json()["predictions"] == [c.post("/embed", json={"inputs": "a"}).json(),
                                             c.post("/embed", json={"inputs": ["b", "c"]}).json()]
        assert c.get("/v1/endpoints/1/deployedModels/2").status_code == 200
        assert c.get("/ping").status_code == 404
