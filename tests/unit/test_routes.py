"""Route rules in-process (the app with the fake HashHandler): what is refused, when, and what a refusal
may say. Real-server behaviour of the same rules is in tests/integration."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from fakes import DIM, HashHandler, loader_for, vector_for
from fastapi.testclient import TestClient
from settingskit import make_settings

from inferd.api.app import create_admin_app, create_app
from inferd.core.errors import ModelLoadError
from inferd.core.spec import ModelSpec

ADMIN = {"Authorization": "Bearer admin-key"}


@contextmanager
def app_client(tmp_path: Path, handler: Any = None, **sections: Any) -> Iterator[tuple[TestClient, HashHandler]]:
    handler = handler or HashHandler()
    loader = handler if callable(handler) and not isinstance(handler, HashHandler) else loader_for(handler)
    # The suite's server: m1 (v1) under tmp_path (its model.root), the admin routes behind "admin-key"; a test's
    # sections change it.
    settings = make_settings(tmp_path / "m1", **{"model.version": "v1", "model.root": [str(tmp_path)],
                                                 "server.admin_key": "admin-key"}, **sections)
    with TestClient(create_app(settings, loader=loader)) as client:
        yield client, handler


def error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}
    return body["error"]


def test_priority_above_the_configured_ceiling_is_refused_and_never_queued(tmp_path: Path) -> None:
    with app_client(tmp_path) as (c, handler):
        err = error(c.post("/predict", json={"texts": ["a"], "priority": 1}), 422)
        assert (err["code"], err["param"]) == ("priority_not_allowed", "priority")
        assert "batching.max_priority" in err["message"]
        assert c.post("/predict", json={"texts": ["b"], "priority": -7}).status_code == 200
        assert handler.batches == [["b"]]
    with app_client(tmp_path, batching={"max_priority": 10}) as (c, _):
        assert c.post("/predict", json={"texts": ["a"], "priority": 10}).status_code == 200
        assert error(c.post("/v1/embeddings", json={"input": "a", "priority": 11}), 422)["param"] == "priority"


@pytest.mark.parametrize("value", [True, False, "5", "5.0", [], {}, 0, -1, 600_001, None])
def test_timeout_ms_is_a_strict_positive_number(tmp_path: Path, value: Any) -> None:
    with app_client(tmp_path) as (c, handler):
        r = c.post("/predict", json={"texts": ["a"], "timeout_ms": value})
        if value is None:
            assert r.status_code == 200
        else:
            assert error(r, 422)["param"] == "timeout_ms"
            assert handler.batches == []


@pytest.mark.parametrize("value", [5000, 2500.5, 600_000])  # an int or a float; long enough not to expire
def test_timeout_ms_takes_ints_and_floats(tmp_path: Path, value: float) -> None:
    with app_client(tmp_path) as (c, _):
        assert c.post("/predict", json={"texts": ["a"], "timeout_ms": value}).status_code == 200


def test_a_wrong_dimensions_is_refused_before_the_model_runs(tmp_path: Path) -> None:
    with app_client(tmp_path) as (c, handler):
        err = error(c.post("/v1/embeddings", json={"input": ["a", "b"], "dimensions": DIM + 1}), 422)
        assert err["param"] == "dimensions" and f"{DIM}-dimensional" in err["message"]
        assert handler.batches == []
        ok = c.post("/v1/embeddings", json={"input": "a", "dimensions": DIM})
        assert ok.json()["data"][0]["embedding"] == vector_for("a")


def test_info_needs_an_inference_key_when_keys_are_set(tmp_path: Path) -> None:
    with app_client(tmp_path, server={"api_keys": ("k1",)}) as (c, _):
        err = error(c.get("/info"), 401)
        assert err["code"] == "invalid_api_key"
        assert c.get("/info", headers={"Authorization": "Bearer k1"}).json()["dimension"] == DIM
        assert c.get("/health/ready").status_code == 200  # health stays public


def test_every_route_but_health_and_metrics_needs_a_key_by_its_router(tmp_path: Path) -> None:
    # Auth is a router dependency: a route added to an inference or admin router later is covered unasked.
    public = {"/health", "/health/live", "/health/ready", "/metrics", "/v2/health/live", "/v2/health/ready"}
    with app_client(tmp_path, server={"api_keys": ("k1",)}) as (c, _):
        paths = c.app.openapi()["paths"]  # the whole schema, admin routes too (the served one hides them)
        routes = [(method.upper(), path) for path, ops in paths.items() for method in ops]
        assert len(routes) >= 14 and {p for _, p in routes} >= {"/v1/rerank", "/v1/classify", "/admin/models"}
        for method, path in routes:
            r = c.request(method, path, headers={"Authorization": "Bearer wrong"})
            if path in public:
                assert r.status_code == 200, (method, path)
            else:
                assert (r.status_code, r.headers.get("WWW-Authenticate")) == (401, "Bearer"), (method, path)
                expected = "admin routes" if path.startswith("/admin") else "inference"
                assert r.json()["error"]["message"].startswith(f"a valid API key is required for {expected}")
        assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200


def test_every_task_route_is_its_own_metric_label(tmp_path: Path) -> None:
    with app_client(tmp_path) as (c, _):
        for path in ("/v1/rerank", "/rerank", "/v1/classify"):  # the fake serves embeddings: 404 on these
            assert c.post(path, json={}).status_code == 404
        text = c.get("/metrics").text
        for path in ("/v1/rerank", "/rerank", "/v1/classify"):
            assert f'inferd_requests_total{{endpoint="{path}",model="",status="404"}} 1.0' in text, path


def test_a_failed_load_says_failed_publicly_and_its_cause_only_to_the_admin(tmp_path: Path) -> None:
    secret = str(tmp_path / "private" / "weights-folder")

    def broken(spec: ModelSpec) -> Any:
        raise ModelLoadError(f"cannot load {secret}: the weights do not fit")

    with app_client(tmp_path, broken) as (c, _):
        ready = c.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        busy = c.post("/predict", json={"texts": ["a"]})
        assert error(busy, 503)["code"] == "model_failed" and busy.headers["Retry-After"]
        for public in (ready, c.get("/health"), c.get("/health/live"), busy):
            assert secret not in public.text and "private" not in public.text
        admin = c.get("/admin/models", headers=ADMIN).json()
        assert admin["state"] == "failed" and secret in admin["reason"]


def test_a_reload_under_a_served_version_gets_409_naming_it(tmp_path: Path) -> None:
    with app_client(tmp_path) as (c, _):
        r = c.post("/admin/models/reload", json={"path": str(tmp_path / "m2"), "version": "v1"}, headers=ADMIN)
        err = error(r, 409)
        assert err["code"] == "version_in_use" and "'v1'" in err["message"] and err["type"] == "conflict_error"
        assert 'inferd_model_reloads_total{outcome="failed"} 1.0' in c.get("/metrics").text
        assert c.post("/predict", json={"texts": ["a"]}).headers["X-Model-Version"] == "v1"


@pytest.mark.parametrize("path", ["m\x00x", "m\nx", "\x7f"])
def test_an_admin_path_with_control_characters_is_a_422_not_a_500(tmp_path: Path, path: str) -> None:
    with app_client(tmp_path) as (c, _):
        r = c.post("/admin/models/reload", json={"path": str(tmp_path / path), "version": "v2"}, headers=ADMIN)
        assert "control characters" in error(r, 422)["message"]


def test_the_admin_listener_has_the_body_limit_too(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "m1", model={"version": "v1", "root": [str(tmp_path)]},
                             server={"admin_key": "admin-key"}, limits={"max_body_bytes": 4096})
    app = create_app(settings, loader=loader_for(HashHandler()))
    with TestClient(app), TestClient(create_admin_app(app)) as admin:
        big = {"path": "x" * 5000, "version": "v2"}
        assert error(admin.post("/admin/models/reload", json=big, headers=ADMIN), 413)["code"] == "body_too_large"
        assert admin.get("/admin/models", headers=ADMIN).status_code == 200


def test_the_docs_are_public_or_off_as_set_and_the_admin_ports_docs_need_the_admin_key(tmp_path: Path) -> None:
    with app_client(tmp_path, server={"api_keys": ("k1",), "docs": "public"}) as (c, _):
        paths = c.get("/openapi.json").json()["paths"]
        assert "/v1/embeddings" in paths and not [p for p in paths if p.startswith("/admin")]
        assert c.get("/docs").status_code == 200 and c.get("/redoc").status_code == 200
    tenants = ({"name": "t", "keys": ["tenant-key"]},)
    with app_client(tmp_path, server={"tenants": tenants}) as (c, _):  # docs: keys, the tenants' keys
        assert error(c.get("/openapi.json"), 401)["code"] == "invalid_api_key"
        assert c.get("/openapi.json", headers={"Authorization": "Bearer tenant-key"}).status_code == 200
    with app_client(tmp_path, server={"docs": "off"}) as (c, _):
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert error(c.get(path), 404)["code"] == "not_found"
    settings = make_settings(tmp_path / "m1", model={"version": "v1", "root": [str(tmp_path)]},
                             server={"admin_key": "admin-key", "admin_port": 0})
    app = create_app(settings, loader=loader_for(HashHandler()))
    with TestClient(app), TestClient(create_admin_app(app)) as admin:
        assert error(admin.get("/openapi.json"), 401)["code"] == "invalid_api_key"
        assert set(admin.get("/openapi.json", headers=ADMIN).json()["paths"]) >= {"/admin/models", "/admin/memory"}


def test_similarity_counts_the_sentences_the_client_sent(tmp_path: Path) -> None:
    # The source sentence takes one of the request's texts; the refusal once said "5 texts given" for 4 sentences.
    with app_client(tmp_path, limits={"max_items_per_request": 4}) as (c, handler):
        sim = {"source_sentence": "a", "sentences": ["b", "c", "d"]}
        assert c.post("/similarity", json={"inputs": sim}).status_code == 200
        r = c.post("/similarity", json={"inputs": {**sim, "sentences": ["b", "c", "d", "e"]}})
        assert r.status_code == 422 and r.json()["error"].startswith(
            "inputs.sentences: 4 sentences given; at most 3 per request"), r.text
        assert len(handler.batches) == 1


def test_a_flood_of_unknown_keys_names_the_first_one_only(tmp_path: Path) -> None:
    body = {"texts": ["a"], **{f"x{i}": 0 for i in range(60_000)}}
    with app_client(tmp_path) as (c, handler):
        err = error(c.post("/predict", json=body), 422)
        assert (err["param"], err["message"]) == ("x0", "x0: unknown field")
        long_key = "k" * 500
        assert error(c.post("/predict", json={"texts": ["a"], long_key: 1}), 422)["param"] == "k" * 40 + "…"
        assert handler.batches == []


def series_versions(metrics: str) -> set[str]:
    return set(re.findall(r'version="([^"]+)"', metrics))


def test_metric_series_of_retired_versions_are_removed(tmp_path: Path) -> None:
    with app_client(tmp_path) as (c, _):
        lines = []
        for n in range(2, 8):
            assert c.post("/predict", json={"texts": [f"t{n}"]}).status_code == 200
            r = c.post("/admin/models/reload", json={"path": str(tmp_path / f"m{n}"), "version": f"v{n}"},
                       headers=ADMIN)
            assert r.status_code == 200, r.text
            assert c.post("/predict", json={"texts": [f"u{n}"]}).status_code == 200
            # The retired model is freed on the worker, a moment after its last request.
            def only_current(n: int = n) -> str:
                text = c.get("/metrics").text
                return text if series_versions(text) == {f"v{n}"} else ""

            lines.append(len(str(wait_for(only_current, 10, f"only v{n} in /metrics")).splitlines()))
        assert len(set(lines[1:])) == 1, lines  # five more reloads, not one line more
