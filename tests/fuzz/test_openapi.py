"""Property-based fuzzing of every route against the app's own OpenAPI schema, with schemathesis.

The app runs in-process (schemathesis's ASGI client, lifespan included) with the fake HashHandler, every
route keyed (one key is both an inference key and the admin key). Each generated request, schema-valid
and schema-violating alike, must get: no 5xx; a status the schema documents; a body that matches the
schema for that status; every error in the one error shape; and a 4xx for a body the schema rules out.
Bounded and deterministic: a fixed number of examples per route, derandomised.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fakes import HashHandler, loader_for
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from settingskit import make_settings

from inferd.api.app import create_app

KEY = "fuzz-key"
# Hypothesis examples per operation (derandomized, so the same ones every run): 60, down from 100, which took 65 s
# of a CI run that was over its 20 minutes.
EXAMPLES = 60
# Health answers 503 with its own documented shape (a state); every other error is the one error shape.
HEALTH = {"/health", "/health/ready", "/health/live"}
# text-embeddings-inference's routes answer in its shape, {"error": str, "error_type": str} (api/tei_shape.py),
# except a refusal before the route runs (401, 413, 405 for another method), which keeps the one shape.
TEI = {"/embed", "/similarity", "/rerank", "/tokenize", "/decode", "/", "/embed_sparse", "/embed_all"}
TEI_TYPES = {"validation", "tokenizer", "empty", "overloaded", "unhealthy", "backend"}
# Cohere's routes answer Cohere's {"id", "message"} with the one shape's "error" beside it (api/cohere.py), again
# except a refusal before the route runs.
COHERE = {"/v1/embed", "/v2/embed", "/v1/rerank", "/v2/rerank"}
# The Open Inference Protocol's routes answer its {"error": str} (api/oip.py), except a refusal before the route runs
# (401, 413, 405) and a path FastAPI cannot read (422 on a GET); its health routes and a model's readiness answer 503
# with their own shapes ({"live"}, {"ready"}, {"name", "ready"}).
OIP = {"/v2", "/v2/models/{name}", "/v2/models/{name}/ready", "/v2/models/{name}/infer",
       "/v2/models/{name}/versions/{version}", "/v2/models/{name}/versions/{version}/ready",
       "/v2/models/{name}/versions/{version}/infer"}
HEALTH |= {"/v2/health/live", "/v2/health/ready"}


def _oip_shaped(path: str, method: str, status: int) -> bool:
    """An answer of the route itself (not of another method: 405 in the one shape) in the protocol's shape."""
    return (path in OIP and method.upper() in ("GET", "POST") and status not in (401, 405, 413)
            and not (status == 422 and method.upper() == "GET"))

MODELS = Path(tempfile.gettempdir()) / "inferd-fuzz-models"  # only a name: the fake loader reads nothing


def make_app() -> FastAPI:
    # model.root "/" lets a generated path load (the fake loader reads nothing), so reloads and canaries with
    # generated versions really switch models; a canary from the start gives promote and rollback work.
    return create_app(make_settings(
        MODELS / "m1", model={"name": "fuzz", "version": "v1", "root": ["/"]},
        canary={"path": str(MODELS / "c1"), "version": "c1", "weight": 0.5},
        server={"admin_key": KEY, "api_keys": [KEY], "access_log": False}), loader=loader_for(HashHandler()))


app = make_app()
# The schema comes from the app itself, whole: the one it serves leaves the admin routes out and is behind the
# keys (api/docs.py). Schemathesis ends an app's lifespan (its engine and worker) when each test item ends, and a
# drained app does not start again: every operation gets an app of its own.
schema = schemathesis.openapi.from_dict(app.openapi())
schema.app = app
schema.config.generation.update(max_examples=EXAMPLES, deterministic=True)


def no_server_fault(ctx: Any, response: Any, case: Any) -> bool | None:
    """No 5xx, except the 504 of a request that chose its own deadline (timeout_ms can be 5e-324 ms)."""
    if response.status_code < 500:
        return None
    chose_deadline = isinstance(case.body, dict) and case.body.get("timeout_ms") is not None
    assert response.status_code == 504 and chose_deadline, f"{response.status_code}: {response.text[:300]}"
    body = response.json()
    if case.path in TEI:  # TEI's shape: the kind is its error_type
        assert body["error_type"] == "overloaded" and "deadline" in body["error"], response.text
    else:
        assert body["error"]["code"] == "deadline_exceeded", response.text
    return True


def one_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error body is {"error": {"message", "type", "code", "param"}} with JSON types to match."""
    if response.status_code < 400 or case.path in HEALTH:
        return None
    body = response.json()
    if case.path in TEI and case.method.upper() == "POST" and response.status_code not in (401, 413):
        assert isinstance(body, dict) and set(body) == {"error", "error_type"}, body
        assert isinstance(body["error"], str) and body["error"] and body["error_type"] in TEI_TYPES, body
        assert "Traceback" not in body["error"], body
        return True
    if _oip_shaped(case.path, case.method, response.status_code):
        if response.status_code == 503 and case.path.endswith("/ready"):
            assert set(response.json()) == {"name", "ready"}, response.text
            return True
        assert isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str), body
        assert body["error"] and "Traceback" not in body["error"], body
        return True
    if case.path in COHERE and case.method.upper() == "POST" and response.status_code not in (401, 413):
        assert isinstance(body, dict) and set(body) == {"id", "message", "error"}, body
        assert body["message"] == body["error"]["message"] and isinstance(body["id"], str), body
        body = {"error": body["error"]}
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert "Traceback" not in error["message"], error
    return True


CHECKS = [no_server_fault, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection, one_error_shape]


@pytest.fixture
def fresh_app() -> FastAPI:
    return make_app()


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
def test_every_route_answers_as_its_schema_says(case: Any, fresh_app: FastAPI) -> None:
    response = case.call(app=fresh_app, headers={"Authorization": f"Bearer {KEY}"})
    case.validate_response(response, checks=CHECKS, headers={"Authorization": f"Bearer {KEY}"})


def test_the_schema_declares_every_routes_bodies() -> None:
    """The inference and admin routes read their bodies by hand; the schema still describes them."""
    doc = app.openapi()
    paths = doc["paths"]
    for path in ("/predict", "/v1/embeddings", "/admin/models/reload", "/admin/models/canary"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["type"] == "object" and body["additionalProperties"] is False and body["required"], path
    assert paths["/predict"]["post"]["requestBody"]["content"]["application/json"]["schema"]["required"] == ["texts"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "200" in responses, (method, path)
            for status, response in responses.items():
                if status != "200" and path not in HEALTH:
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    tei = path in TEI and status not in ("401", "413")
                    expected = "/TEIError" if tei else "/ErrorResponse"
                    if _oip_shaped(path, method, int(status)):
                        expected = "/ModelReady" if status == "503" and path.endswith("/ready") else "/OIPErrorBody"
                    assert ref.endswith(expected), (method, path, status)
    assert {"ErrorResponse", "PredictResponse", "EmbeddingsResponse", "Info", "Health"} <= set(
        doc["components"]["schemas"])
