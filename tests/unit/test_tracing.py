"""OpenTelemetry traces in-process (the app with the fake HashHandler, spans in the SDK's in-memory exporter):
the span tree of a request, the caller's trace continued, a batch's span linked to every request it served,
the trace id in the access line; and, with tracing off, no span at all. Export over OTLP to a real receiver
is tests/integration/test_tracing.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from fakes import HashHandler, loader_for
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Tracer
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Link, SpanContext, SpanKind, StatusCode, TraceFlags
from settingskit import make_settings

from inferd.api.app import create_app
from inferd.api.services import services_of
from inferd.utils import tracing
from inferd.utils.logger import JsonFormatter, RequestIdFilter
from inferd.utils.trace_export import (
    LinkedSampler,
    TracingConfigError,
    build_provider,
    configure_tracing,
    exporter_names,
    resource,
    sampler_from,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for one test, every span in memory as it ends."""
    exporter = InMemorySpanExporter()
    provider = build_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


@pytest.fixture
def lines() -> Iterator[list[logging.LogRecord]]:
    """The access and batch log records, whatever logging configuration an earlier test left."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    loggers = [logging.getLogger("inferd.access"), logging.getLogger("inferd.batch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield records
    for lg, level in zip(loggers, levels, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)


@contextmanager
def app_client(tmp_path: Path) -> Iterator[tuple[TestClient, HashHandler]]:
    handler = HashHandler()
    settings = make_settings(tmp_path / "m1", model={"name": "m1", "version": "v1"},
                             batching={"min_padding_efficiency": 0.0})
    with TestClient(create_app(settings, loader=loader_for(handler))) as client:
        try:
            yield client, handler
        finally:
            for gate in handler.gates.values():
                gate.set()


def by_name(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str, trace_id: int | None = None) -> ReadableSpan:
    found = [s for s in by_name(exporter, name) if trace_id is None or s.context.trace_id == trace_id]
    assert len(found) == 1, [(s.name, s.context) for s in exporter.get_finished_spans()]
    return found[0]


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in exporter.get_finished_spans():
        if s.parent is not None and s.parent.span_id == parent.context.span_id:
            out.setdefault(s.name, []).append(s)
    return out


def access_line(records: list[logging.LogRecord]) -> dict[str, Any]:
    """The last access record as the JSON log line it is written as."""
    [record] = [r for r in records if r.name == "inferd.access"][-1:]
    return json.loads(JsonFormatter().format(record))


def hold_worker(client: TestClient, handler: HashHandler, pool: ThreadPoolExecutor) -> Any:
    handler.gates["g"] = threading.Event()
    held = pool.submit(client.post, "/predict", json={"texts": ["hold:g"]})
    wait_for(lambda: any("hold:g" in b for b in handler.batches), 10, "the held batch")
    return held


def test_a_request_continues_the_callers_trace_with_tokenize_queue_and_inference_children(
        tmp_path: Path, spans: InMemorySpanExporter, lines: list[logging.LogRecord]) -> None:
    with app_client(tmp_path) as (client, _):
        r = client.post("/predict", json={"texts": ["hello", "hi"]},
                        headers={"traceparent": TRACEPARENT, "tracestate": "vendor=opaque"})
    assert r.status_code == 200, r.text
    server = one(spans, "POST /predict")
    assert server.kind is SpanKind.SERVER
    assert f"{server.context.trace_id:032x}" == TRACE_ID  # the caller's trace, continued
    assert server.parent is not None and server.parent.is_remote and f"{server.parent.span_id:016x}" == PARENT_ID
    assert server.context.trace_state.get("vendor") == "opaque"
    attrs = server.attributes
    assert attrs["http.route"] == "/predict" and attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 200 and server.status.status_code is StatusCode.UNSET
    assert (attrs["inferd.model.name"], attrs["inferd.model.version"]) == ("m1", "v1")
    assert (attrs["inferd.items"], attrs["inferd.tokens"]) == (2, len("hello") + len("hi"))  # a token a character
    assert attrs["inferd.request_id"] == r.headers["X-Request-ID"]

    kids = children(spans, server)
    assert {name: len(s) for name, s in kids.items()} == {"tokenize": 1, "queue": 1, "inference": 1}
    [tokenize], [queue], [inference] = kids["tokenize"], kids["queue"], kids["inference"]
    assert tokenize.end_time <= queue.start_time and queue.end_time == inference.start_time  # the batch's start
    assert server.start_time <= tokenize.start_time and inference.end_time <= server.end_time

    # The batch: the root of its own trace, linked to the request; the request's inference span names it.
    batch = one(spans, "batch")
    assert batch.parent is None and batch.context.trace_id != server.context.trace_id
    assert [link.context.span_id for link in batch.links] == [server.context.span_id]
    assert batch.links[0].attributes == {"inferd.items": 2}
    assert (batch.attributes["inferd.batch.size"], batch.attributes["inferd.batch.padded_tokens"]) == (2, 10)
    assert batch.attributes["inferd.batch.tokens"] == 7
    assert (batch.attributes["inferd.model.name"], batch.attributes["inferd.model.version"]) == ("m1", "v1")
    assert [link.context.span_id for link in inference.links] == [batch.context.span_id]
    assert inference.attributes["inferd.batch.span_id"] == f"{batch.context.span_id:016x}"
    assert inference.attributes["inferd.batch.trace_id"] == f"{batch.context.trace_id:032x}"
    assert (inference.start_time, inference.end_time) == (batch.start_time, batch.end_time)

    line = access_line(lines)
    assert line["trace_id"] == TRACE_ID and line["span_id"] == f"{server.context.span_id:016x}"
    assert line["tokens"] == 7
    [batch_line] = [r for r in lines if r.name == "inferd.batch"]
    assert batch_line.trace_ids == [TRACE_ID]  # type: ignore[attr-defined]
    assert batch_line.trace_id == f"{batch.context.trace_id:032x}"  # type: ignore[attr-defined]


def test_a_batch_serving_two_concurrent_requests_links_both(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    with app_client(tmp_path) as (client, handler), ThreadPoolExecutor(3) as pool:
        held = hold_worker(client, handler, pool)
        pending = [pool.submit(client.post, "/predict", json={"texts": [text]}) for text in ("aa", "bb")]
        engine = services_of(client.app).engine
        wait_for(lambda: len(engine.queue) == 2, 10, "both requests queued behind the held batch")
        handler.gates["g"].set()
        assert held.result(10).status_code == 200
        assert [f.result(10).status_code for f in pending] == [200, 200]
    assert sorted(handler.batches[1]) == ["aa", "bb"]  # one batch served both
    servers = by_name(spans, "POST /predict")
    assert len(servers) == 3 and len({s.context.trace_id for s in servers}) == 3  # no traceparent: new traces
    [batch] = [s for s in by_name(spans, "batch") if s.attributes["inferd.batch.size"] == 2]
    linked = {(link.context.trace_id, link.context.span_id) for link in batch.links}
    shared = [s for s in servers if (s.context.trace_id, s.context.span_id) in linked]
    assert len(batch.links) == 2 and len(shared) == 2
    for server in shared:
        [inference] = children(spans, server)["inference"]
        assert inference.links[0].context.span_id == batch.context.span_id
        assert inference.attributes["inferd.batch.size"] == 2


@pytest.mark.parametrize("traceparent", [
    None,
    "not a traceparent",
    f"00-{'0' * 32}-{PARENT_ID}-01",  # an all-zero trace id is invalid
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
    f"00-{TRACE_ID}-{PARENT_ID}",  # no flags
])
def test_without_a_valid_traceparent_a_new_trace_starts(
        tmp_path: Path, spans: InMemorySpanExporter, traceparent: str | None) -> None:
    headers = {} if traceparent is None else {"traceparent": traceparent}
    with app_client(tmp_path) as (client, _):
        assert client.post("/v1/embeddings", json={"input": "a"}, headers=headers).status_code == 200
    server = one(spans, "POST /v1/embeddings")
    assert server.parent is None and server.context.trace_id not in (0, int(TRACE_ID, 16))
    assert {"tokenize", "queue", "inference"} <= set(children(spans, server))


def test_two_traceparent_headers_start_a_new_trace(spans: InMemorySpanExporter) -> None:
    # The W3C trace-context suite's duplicated-traceparent case: neither header is continued.
    other = f"00-{'1' * 32}-{PARENT_ID}-01"
    server = tracing.server_span({"type": "http", "method": "POST", "path": "/predict", "headers": [
        (b"traceparent", TRACEPARENT.encode()), (b"traceparent", other.encode()),
        (b"tracestate", b"vendor=opaque")]}, "/predict")
    assert server is not None
    server.end(200, {})
    [span] = spans.get_finished_spans()
    assert span.parent is None and span.context.trace_id not in (int(TRACE_ID, 16), int("1" * 32, 16))
    assert len(span.context.trace_state) == 0


def test_a_caller_that_sampled_its_trace_out_gets_no_spans_but_the_log_keeps_its_trace_id(
        tmp_path: Path, spans: InMemorySpanExporter, lines: list[logging.LogRecord]) -> None:
    with app_client(tmp_path) as (client, _):
        r = client.post("/predict", json={"texts": ["a"]}, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    assert r.status_code == 200
    # Parent-based sampling: nothing recorded, not even the batch (the worker makes no span for it).
    assert spans.get_finished_spans() == ()
    assert access_line(lines)["trace_id"] == TRACE_ID


def test_a_request_answered_in_the_queue_ends_its_wait_with_the_reason(
        tmp_path: Path, spans: InMemorySpanExporter) -> None:
    with app_client(tmp_path) as (client, handler), ThreadPoolExecutor(2) as pool:
        held = hold_worker(client, handler, pool)
        r = client.post("/predict", json={"texts": ["late"], "timeout_ms": 50})
        handler.gates["g"].set()
        assert held.result(10).status_code == 200
    assert r.status_code == 504
    server = next(s for s in by_name(spans, "POST /predict") if s.attributes["http.response.status_code"] == 504)
    kids = children(spans, server)
    assert set(kids) == {"tokenize", "queue"}  # it never ran in a batch
    [queue] = kids["queue"]
    assert queue.status.status_code is StatusCode.ERROR and queue.attributes["error.type"] == "deadline"
    # A 5xx is a server span's error (semantic conventions), named by its status.
    assert server.status.status_code is StatusCode.ERROR and server.attributes["error.type"] == "504"


def test_probes_and_scrapes_are_not_traced_and_unknown_paths_are_named_by_method(
        tmp_path: Path, spans: InMemorySpanExporter) -> None:
    with app_client(tmp_path) as (client, _):
        for path in ("/health", "/health/live", "/health/ready", "/metrics"):
            assert client.get(path).status_code == 200
        assert client.get("/wp-login.php").status_code == 404
    [span] = spans.get_finished_spans()
    assert span.name == "GET" and "http.route" not in span.attributes
    assert (span.attributes["url.path"], span.attributes["http.response.status_code"]) == ("/wp-login.php", 404)


def test_a_line_logged_inside_a_traced_request_carries_its_ids(spans: InMemorySpanExporter) -> None:
    def record() -> logging.LogRecord:
        r = logging.LogRecord("inferd.core.x", logging.WARNING, __file__, 1, "inside", (), None)
        RequestIdFilter().filter(r)
        return r

    server = tracing.server_span({"type": "http", "method": "POST", "path": "/predict", "headers": [
        (b"traceparent", TRACEPARENT.encode())]}, "/predict")
    assert server is not None
    with tracing.span("tokenize"):
        inside = record()
    server.end(200, {})
    [tokenize] = by_name(spans, "tokenize")
    assert (inside.trace_id, inside.span_id) == (TRACE_ID, f"{tokenize.context.span_id:016x}")  # type: ignore[attr-defined]
    assert not hasattr(record(), "trace_id")  # outside a request


def test_off_no_provider_is_installed_and_no_span_is_started(
        tmp_path: Path, lines: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch) -> None:
    assert configure_tracing({}) is None
    assert tracing.provider() is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # the global one is never set

    def no_span(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a span was started with tracing off")

    for tracer in (Tracer, trace.ProxyTracer, trace.NoOpTracer):
        monkeypatch.setattr(tracer, "start_span", no_span)
        monkeypatch.setattr(tracer, "start_as_current_span", no_span)
    with app_client(tmp_path) as (client, _):
        r = client.post("/predict", json={"texts": ["a", "b"]}, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    line = access_line(lines)
    assert "trace_id" not in line and "span_id" not in line
    [batch_line] = [r for r in lines if r.name == "inferd.batch"]
    assert not hasattr(batch_line, "trace_ids")


def test_off_the_request_path_never_imports_the_sdk() -> None:
    code = ("import sys; import inferd.api.app, inferd.core.worker, inferd.utils.logger; "
            "sdk = sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')); assert not sdk, sdk")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# -- the OTEL_* variables -----------------------------------------------------------------------------


@pytest.mark.parametrize(("environ", "names"), [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_BSP_SCHEDULE_DELAY": "10"}, []),  # no exporter named: off
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
])
def test_tracing_is_on_only_when_an_exporter_is_configured(environ: dict[str, str], names: list[str]) -> None:
    assert exporter_names(environ) == names


@pytest.mark.parametrize(("environ", "variable"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     "OTEL_TRACES_SAMPLER_ARG"),
])
def test_a_value_that_cannot_be_used_is_refused_naming_the_variable(environ: dict[str, str], variable: str) -> None:
    with pytest.raises(TracingConfigError, match=variable):
        configure_tracing(environ)
    assert tracing.provider() is None


def test_the_sampler_and_the_service_name_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sampler_from({}).get_description().startswith("ParentBased{root:AlwaysOnSampler")
    ratio = sampler_from({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert "0.25" in ratio.get_description()
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert resource().attributes["service.name"] == "inferd"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "embedder-eu")
    assert resource().attributes["service.name"] == "embedder-eu"


def test_a_root_span_linked_to_a_sampled_span_is_sampled_whatever_the_sampler() -> None:
    sampler = LinkedSampler(ALWAYS_OFF)
    sampled = SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    unsampled = SpanContext(1, 3, is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    assert sampler.should_sample(None, 7, "batch", links=[Link(unsampled), Link(sampled)]).decision.is_sampled()
    assert not sampler.should_sample(None, 7, "batch", links=[Link(unsampled)]).decision.is_sampled()
    assert not sampler.should_sample(None, 7, "request").decision.is_sampled()
