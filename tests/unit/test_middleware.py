"""The request metrics' endpoint label: an app's own route paths as they are, anything else "other"."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import metric_value
from fakes import HashHandler, loader_for
from fastapi import FastAPI
from fastapi.testclient import TestClient
from settingskit import make_settings
from starlette.datastructures import MutableHeaders

from inferd.api.app import create_admin_app, create_app, route_paths
from inferd.api.middleware import set_headers

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


def _by_mutable_headers(headers: list[tuple[bytes, bytes]], sets: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    message = {"type": "http.response.start", "status": 200, "headers": list(headers)}
    mutable = MutableHeaders(scope=message)
    for name, value in sets:
        mutable[name] = value
    return message["headers"]


@pytest.mark.parametrize("headers", [
    [(b"content-type", b"application/json"), (b"content-length", b"2")],
    # a name set again: replaced where it stood, its repeats dropped
    [(b"x-request-id", b"old"), (b"content-length", b"2"), (b"x-request-id", b"older")],
    [],
])
@pytest.mark.parametrize("sets", [
    [("X-Request-ID", "abc"), ("X-Process-Time", "1.500")],
    [("X-Request-ID", "abc"), ("x-request-id", "again")],  # the same name twice: the last value wins
])
def test_response_headers_are_set_as_starlettes_mutable_headers_sets_them(headers: list, sets: list) -> None:
    message = {"type": "http.response.start", "status": 200, "headers": list(headers)}
    set_headers(message, sets)
    assert message["headers"] == _by_mutable_headers(headers, sets)
