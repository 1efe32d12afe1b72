"""Metrics, JSON logs, timing headers and /admin/memory, against one real server (prod config, tiny model)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Server
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from settingskit import make_settings

from inferd.api.app import create_app
from inferd.api.services import services_of

ADMIN_KEY = "admin-" + uuid.uuid4().hex
VERSION = "v1"
MODEL = "all-MiniLM-L6-v2"  # the default model.name
SECRET_TEXT = "the confidential mountain sentence"
# Pairs of texts with the same token count: the padded batch cost is then exactly the prompt tokens.
PAIRS = [["hello world", "the cat"], ["fast dog", "slow tree"], ["one two", "three four"]]

Samples = dict[tuple[str, tuple], float]


@pytest.fixture(scope="module")
def server(tiny_model: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve({
        "INFERD_ENV": "prod",  # JSON logs, as in production
        "INFERD__MODEL__BACKEND": "torch",  # prod.yaml's auto would export in the background
        "INFERD__MODEL__PATH": str(tiny_model),
        "INFERD__MODEL__VERSION": VERSION,
        "INFERD__SERVER__ADMIN_KEY": ADMIN_KEY,
        # Two texts of different lengths must share one batch for the batch figures checked here.
        "INFERD__BATCHING__MIN_PADDING_EFFICIENCY": "0",
    }, wait="/health/ready")


def scrape(server: Server) -> tuple[Samples, set[str]]:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    samples: Samples = {}
    families = set()
    for family in text_string_to_metric_families(r.text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def value(samples: Samples, name: str, /, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, /, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def json_lines(server: Server) -> list[dict[str, Any]]:
    out = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def wait_for_line(server: Server, match, timeout: float = 10.0) -> dict[str, Any]:
    """The access line is written after the response is sent, so it may trail the client by a moment."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in json_lines(server) if match(line)]
        if found:
            return found[-1]
        if time.monotonic() > deadline:
            raise AssertionError(f"no matching log line; log tail:\n{server.log()[-3000:]}")
        time.sleep(0.05)


def test_metrics_move_as_expected_after_known_requests(server: Server) -> None:
    before, _ = scrape(server)
    tokens = 0
    with server.client() as c:
        for pair in PAIRS:  # one after another: each request is exactly one batch of two
            r = c.post("/predict", json={"texts": pair})
            assert r.status_code == 200, r.text
            tokens += r.json()["usage"]["prompt_tokens"]
        r = c.post("/v1/embeddings", json={"input": "a single text"})
        assert r.status_code == 200, r.text
        tokens += r.json()["usage"]["prompt_tokens"]
        r = c.post("/predict", json={"texts": ["fine", ""]})
        assert r.status_code == 422
    after, families = scrape(server)
    d = lambda name, **labels: delta(before, after, name, **labels)  # noqa: E731
    assert d("inferd_requests_total", endpoint="/predict", status="200", model=MODEL) == 3
    assert d("inferd_requests_total", endpoint="/v1/embeddings", status="200", model=MODEL) == 1
    # Refused by the model-free checks: no model had been chosen.
    assert d("inferd_requests_total", endpoint="/predict", status="422", model="") == 1
    assert d("inferd_request_duration_seconds_count", endpoint="/predict", model=MODEL) == 3
    assert d("inferd_request_duration_seconds_count", endpoint="/predict", model="") == 1
    assert d("inferd_requests_rejected_total", reason="invalid") == 1
    assert d("inferd_version_requests_total", model=MODEL, version=VERSION) == 4
    # One observation per stage: preprocess per request, queue per text, inference/postprocess per batch.
    assert d("inferd_preprocess_duration_seconds_count", model=MODEL, version=VERSION) == 4
    assert d("inferd_queue_duration_seconds_count", model=MODEL, version=VERSION) == 7
    assert d("inferd_inference_duration_seconds_count", model=MODEL, version=VERSION) == 4
    assert d("inferd_postprocess_duration_seconds_count", model=MODEL, version=VERSION) == 4
    assert d("inferd_batch_size_count", model=MODEL, version=VERSION) == 4
    assert d("inferd_batch_size_sum", model=MODEL, version=VERSION) == 7
    assert d("inferd_batch_size_bucket", model=MODEL, version=VERSION, le="1.0") == 1
    assert d("inferd_batch_size_bucket", model=MODEL, version=VERSION, le="2.0") == 4
    assert d("inferd_batch_tokens_sum", model=MODEL, version=VERSION) == tokens
    assert d("inferd_inference_duration_seconds_sum", model=MODEL, version=VERSION) > 0
    assert value(after, "inferd_queue_depth", model=MODEL) == 0
    assert value(after, "inferd_requests_in_flight") == 0
    assert value(after, "inferd_model_info", slot="active", model=MODEL, version=VERSION, task="embedding",
                 device="cpu", dtype="float32", backend="torch", quantize="none") == 1
    assert value(after, "inferd_model_load_seconds", model=MODEL, version=VERSION) > 0
    assert value(after, "process_resident_memory_bytes") > 0
    # No GPU here: the GPU families are declared (dashboards see the names) but carry no samples.
    assert "inferd_gpu_memory_allocated_bytes" in families and "inferd_gpu_utilization_ratio" in families
    assert not [k for k in after if k[0].startswith("inferd_gpu_")]


def test_timing_headers(server: Server) -> None:
    with server.client() as c:
        r = c.post("/predict", json={"texts": ["hello world"]})
    assert r.status_code == 200
    process, queue, inference = (float(r.headers[h]) for h in ("X-Process-Time", "X-Queue-Time",
                                                                  "X-Inference-Time"))
    assert queue >= 0 and inference > 0
    assert inference <= process  # the forward pass is part of the request
    assert r.headers["X-Model-Version"] == VERSION


def test_json_access_line_and_batch_line(server: Server) -> None:
    rid = "obs-" + uuid.uuid4().hex
    with server.client() as c:
        r = c.post("/predict", json={"texts": [SECRET_TEXT, "the cat"]}, headers={"X-Request-ID": rid})
    assert r.status_code == 200 and r.headers["X-Request-ID"] == rid
    line = wait_for_line(server, lambda x: x.get("request_id") == rid and x.get("logger") == "inferd.access")
    assert line["message"] == "POST /predict 200"
    assert (line["endpoint"], line["status"], line["items"], line["batch_size"]) == ("/predict", 200, 2, 2)
    assert line["version"] == VERSION and line["level"] == "INFO"
    for key in ("duration_ms", "queue_ms", "preprocess_ms", "inference_ms", "postprocess_ms"):
        assert isinstance(line[key], (int, float)) and line[key] >= 0, key
    assert line["duration_ms"] >= line["inference_ms"]
    batches = [x for x in json_lines(server) if x.get("logger") == "inferd.batch"]
    assert batches
    for b in batches:
        assert b["batch_size"] >= 1 and b["batch_tokens"] >= b["real_tokens"] > 0
        assert b["duration_ms"] >= b["inference_ms"] >= 0 and b["version"] == VERSION
    # Input text is never logged by default, only sizes.
    assert "confidential" not in server.log()
    assert "inputs" not in line
    # No OTEL_* variables: tracing is off, and no line carries a trace id (tests/integration/test_tracing.py).
    assert "trace_id" not in line and not [b for b in batches if "trace_id" in b or "trace_ids" in b]


def test_admin_memory_requires_the_admin_key(server: Server) -> None:
    before, _ = scrape(server)
    with server.client() as c:
        missing = c.get("/admin/memory")
        wrong = c.get("/admin/memory", headers={"Authorization": "Bearer not-the-key"})
        right = c.get("/admin/memory", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    for r in (missing, wrong):
        assert r.status_code == 401
        assert set(r.json()["error"]) == {"message", "type", "code", "param"}
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert right.status_code == 200, right.text
    body = right.json()
    assert body["device"] == "cpu" and body["allocated_bytes"] > 0 and body["peak_bytes"] >= body["allocated_bytes"]
    assert body["summary"] is None  # torch.cuda.memory_summary() only on a GPU
    assert body["check_every_n"] == 1000 and body["fragmentation_threshold"] == 0.3
    assert "expandable_segments" in body["alloc_conf"]  # memory.expandable_segments, set before CUDA starts
    after, _ = scrape(server)
    assert delta(before, after, "inferd_requests_total", endpoint="/admin/memory", status="401", model="") == 2
    assert delta(before, after, "inferd_requests_total", endpoint="/admin/memory", status="200", model="") == 1


def test_admin_memory_is_absent_without_an_admin_key(tiny_model: Path) -> None:
    settings = make_settings(tiny_model, layered="dev", model={"load_mode": "lazy"})
    with TestClient(create_app(settings)) as client:  # create_app builds its own guard
        assert services_of(client.app).memory_guard is not None
        for headers in ({}, {"Authorization": "Bearer anything"}):
            r = client.get("/admin/memory", headers=headers)
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "not_found"
