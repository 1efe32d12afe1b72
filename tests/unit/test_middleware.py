"""The request metrics' endpoint label: an app's own route paths as they are, anything else "other"."""

from __future__ import annotations

from pathlib import Path

from conftest import metric_value
from fakes import HashHandler, loader_for
from fastapi import FastAPI
from fastapi.testclient import TestClient
from settingskit import make_settings

from inferd.api.app import create_admin_app, create_app, route_paths

ADMIN_PATHS = {"/admin/memory", "/admin/models/reload", "/admin/models/canary", "/admin/models/promote",
               "/admin/models/rollback", "/admin/models", "/admin/models/shadow", "/admin/models/shadow/promote",
               "/admin/models/reload/cancel",
               "/admin/usage"}
SERVING_PATHS = {"/predict", "/v1/embeddings", "/v1/rerank", "/v2/rerank", "/rerank", "/v1/classify", "/v1/models",
                 "/info", "/health", "/health/live", "/health/ready", "/metrics",
                 # text-embeddings-inference's and Cohere's embedding routes
                 "/", "/embed", "/similarity", "/tokenize", "/decode", "/v1/embed", "/v2/embed",
                 # sparse and multi-vector outputs: TEI's routes and inferd's own
                 "/embed_sparse", "/embed_all", "/v1/encode",
                 # the Open Inference Protocol's (a route with parameters is labelled by its template)
                 "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/ready",
                 "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}",
                 "/v2/models/{name}/versions/{version}/ready", "/v2/models/{name}/versions/{version}/infer"}


def served(app: FastAPI) -> set[str]:
    """The paths the app answers (its OpenAPI paths: every route of ours is in the schema)."""
    return set(app.openapi()["paths"])


def test_the_labels_are_the_route_table_and_not_the_docs(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "m1", model={"version": "v1"}, server={"admin_key": "admin-key"})
    assert route_paths(settings) == SERVING_PATHS | ADMIN_PATHS == served(create_app(settings))
    assert not {"/docs", "/redoc", "/openapi.json"} & route_paths(settings)


def test_with_an_admin_port_each_app_labels_the_routes_it_serves(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "m1", model={"version": "v1"},
                             server={"admin_key": "admin-key", "admin_port": 0})
    main = create_app(settings)
    assert route_paths(settings) == SERVING_PATHS == served(main)
    assert route_paths(settings, admin=True) == ADMIN_PATHS == served(create_admin_app(main))


def test_a_path_the_app_does_not_serve_counts_as_other(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "m1", model={"version": "v1"}, server={"admin_key": "admin-key"})
    app = create_app(settings, loader=loader_for(HashHandler()))
    with TestClient(app) as client:
        assert client.post("/predict", json={"texts": ["a"]}).status_code == 200
        assert client.get("/wp-login.php").status_code == 404
        exposition = client.get("/metrics").text
    assert metric_value(exposition, "inferd_requests_total", endpoint="/predict", status="200") == 1
    assert metric_value(exposition, "inferd_requests_total", endpoint="other", status="404") == 1
    assert 'endpoint="/wp-login.php"' not in exposition


def test_a_route_with_parameters_is_labelled_by_its_template_not_the_path_sent(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "m1", model={"version": "v1"})
    with TestClient(create_app(settings, loader=loader_for(HashHandler()))) as client:
        for name in ("all-MiniLM-L6-v2", "nope", "a/b"):
            client.get(f"/v2/models/{name}/ready")
        exposition = client.get("/metrics").text
    template = "/v2/models/{name}/ready"
    assert metric_value(exposition, "inferd_requests_total", endpoint=template, status="200") == 1
    assert metric_value(exposition, "inferd_requests_total", endpoint=template, status="404") == 2
    assert "/v2/models/nope" not in exposition
