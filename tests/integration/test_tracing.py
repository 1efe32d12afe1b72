"""Traces leave a real server over OTLP/HTTP: a receiver run by the test (POST /v1/traces, the protobuf body
decoded as opentelemetry-proto's ExportTraceServiceRequest) gets the request's span tree in the caller's
trace and the batch's span linked to it, configured by nothing but the standard OTEL_* variables."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import Server
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP trace receiver on a free 127.0.0.1 port: every span it is sent, with its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Span]] = []
        self.posts: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    receiver.posts.append(f"{self.path} {self.headers.get('Content-Type')}")
                    for resource_spans in request.resource_spans:
                        resource = attributes(resource_spans.resource.attributes)
                        for scope_spans in resource_spans.scope_spans:
                            receiver.spans += [(resource, s) for s in scope_spans.spans]
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def received(self) -> list[tuple[dict[str, Any], Span]]:
        with self.lock:
            return list(self.spans)

    def wait(self, found: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = [s for _, s in self.received()]
            if found(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"spans not received in {timeout}s: {[s.name for _, s in self.received()]}")


def value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.http.shutdown()
        r.http.server_close()


def json_lines(server: Server) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


def wait_for_line(server: Server, match: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in json_lines(server) if match(line)]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no matching log line; log tail:\n{server.log()[-3000:]}")


def test_a_requests_spans_are_exported_over_otlp_in_the_callers_trace(
        serve: Callable[..., Server], tiny_model: Path, receiver: Receiver) -> None:
    server = serve(env={
        "INFERD_ENV": "prod",  # JSON logs
        "INFERD__MODEL__BACKEND": "torch",  # prod.yaml's auto would export in the background
        "INFERD__MODEL__PATH": str(tiny_model),
        "INFERD__MODEL__VERSION": "v1",
        "INFERD__BATCHING__MIN_PADDING_EFFICIENCY": "0",  # both texts in one batch
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_SERVICE_NAME": "inferd-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # milliseconds: the test waits little for its spans
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }, wait="/health/ready")
    with server.client() as c:
        r = c.post("/predict", json={"texts": ["hello world", "the cat"]},
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-ID": "traced-1"})
    assert r.status_code == 200, r.text
    ours = bytes.fromhex(TRACE_ID)

    def complete(spans: list[Span]) -> bool:
        names = {s.name for s in spans if s.trace_id == ours}
        linked = any(link.trace_id == ours for s in spans if s.name == "batch" for link in s.links)
        return {"POST /predict", "tokenize", "queue", "inference"} <= names and linked

    spans = receiver.wait(complete)
    [server_span] = [s for s in spans if s.trace_id == ours and s.name == "POST /predict"]
    assert server_span.kind == Span.SPAN_KIND_SERVER and server_span.parent_span_id.hex() == PARENT_ID
    attrs = attributes(server_span.attributes)
    assert (attrs["http.route"], attrs["http.response.status_code"], attrs["inferd.items"]) == ("/predict", 200, 2)
    assert attrs["inferd.model.version"] == "v1" and attrs["inferd.tokens"] == r.json()["usage"]["prompt_tokens"]
    assert attrs["inferd.request_id"] == "traced-1"
    kids = {s.name: s for s in spans if s.trace_id == ours and s.parent_span_id == server_span.span_id}
    assert set(kids) == {"tokenize", "queue", "inference"}
    [batch] = [s for s in spans if s.name == "batch" and any(link.span_id == server_span.span_id for link in s.links)]
    assert batch.trace_id != ours and not batch.parent_span_id
    assert attributes(batch.attributes)["inferd.batch.size"] == 2
    assert [link.span_id for link in kids["inference"].links] == [batch.span_id]
    # The resource: the service as OTEL_SERVICE_NAME names it; the probes left no span.
    assert {res["service.name"] for res, _ in receiver.received()} == {"inferd-under-test"}
    assert not [s for s in spans if s.name.startswith("GET")]
    assert set(receiver.posts) == {"/v1/traces application/x-protobuf"}

    line = wait_for_line(server, lambda x: x.get("logger") == "inferd.access" and x.get("request_id") == "traced-1")
    assert line["trace_id"] == TRACE_ID and line["span_id"] == server_span.span_id.hex()
    batch_line = wait_for_line(server, lambda x: x.get("logger") == "inferd.batch"
                               and TRACE_ID in x.get("trace_ids", ()))
    assert batch_line["trace_id"] == batch.trace_id.hex()
    assert server.stop() == 0
