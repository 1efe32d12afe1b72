"""OpenTelemetry traces: the spans inferd makes, off unless a tracer provider is installed.

A traced request is a SERVER span (api/middleware.py) that continues the caller's W3C ``traceparent`` (and
``tracestate``), or starts a trace when no valid one came (a malformed header is ignored). Its children are
``tokenize`` (preprocessing), ``queue`` (from the enqueue to the start of its first batch, or to its answer
when no batch ran it) and one ``inference`` per batch that computed its items. A batch serves many
requests, so it is a span of its own, ``batch``, the root of its own trace, made on the worker thread; it
links to each request's span, and each request's ``inference`` span links back to it and names it.

The provider comes from the standard ``OTEL_*`` variables (utils/trace_export.py, at start-up) or from a
test. Off, the module holds no tracer: every hook is a test of ``_tracer is None`` returning None (or a
shared no-op context manager), and the OpenTelemetry SDK is never imported. Only the API is imported here
(FastAPI imports it anyway).

inferd keeps its provider to itself and never installs the global one: FastAPI's native telemetry starts
whenever a global provider is set and would add a second server span to every request.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, StatusCode, format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inferd import __version__

_tracer: trace.Tracer | None = None
_provider: trace.TracerProvider | None = None

_PROPAGATOR = TraceContextTextMapPropagator()
_NO_SPAN = contextlib.nullcontext()
# What the request context (api/middleware.py ``context``) says of a request, as server span attributes.
_DETAILS = (("request_id", "inferd.request_id"), ("model", "inferd.model.name"),
            ("version", "inferd.model.version"), ("items", "inferd.items"), ("tokens", "inferd.tokens"),
            ("cache_hits", "inferd.cache_hits"), ("batch_size", "inferd.batch_size"))


def install(provider: trace.TracerProvider) -> None:
    """Trace through ``provider`` from now on (start-up, or a test); its owner shuts it down."""
    global _tracer, _provider
    _tracer = provider.get_tracer("inferd", __version__)
    _provider = provider


def uninstall() -> trace.TracerProvider | None:
    """Tracing off again; returns the provider that was installed, if any."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    return provider


def provider() -> trace.TracerProvider | None:
    return _provider


def current_ids() -> tuple[str, str] | None:
    """The trace and span id (hex) of the span current here, for a log line; None when none or off."""
    if _tracer is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    return (format_trace_id(ctx.trace_id), format_span_id(ctx.span_id)) if ctx.is_valid else None


# -- the request's span (event loop) -------------------------------------------------------------------


class ServerSpan:
    """A request's SERVER span, the current span from ``server_span`` until ``end``."""

    __slots__ = ("span", "_token")

    def __init__(self, span: trace.Span, token: object) -> None:
        self.span = span
        self._token = token

    @property
    def ids(self) -> tuple[str, str]:
        ctx = self.span.get_span_context()
        return format_trace_id(ctx.trace_id), format_span_id(ctx.span_id)

    def end(self, status: int, details: Mapping[str, Any]) -> None:
        """The response's status and what the request context says (model, version, items, tokens)."""
        span = self.span
        if span.is_recording():
            attributes: dict[str, Any] = {"http.response.status_code": status}
            for key, name in _DETAILS:
                value = details.get(key)
                if isinstance(value, str | int | float) and not isinstance(value, bool):
                    attributes[name] = value
            span.set_attributes(attributes)
            if status >= 500:  # a server span's error; a 4xx is the client's (semantic conventions)
                span.set_attribute("error.type", str(status))
                span.set_status(StatusCode.ERROR)
        span.end()
        otel_context.detach(self._token)


def server_span(scope: Mapping[str, Any], route: str | None) -> ServerSpan | None:
    """Start an HTTP request's SERVER span, current until ``end``; None when tracing is off.

    ``route`` is the app's route for the path (None for a path no route serves: the span is named by the
    method alone, as the semantic conventions ask, so 404 scans cannot multiply span names).
    """
    tracer = _tracer
    if tracer is None:
        return None
    carrier: dict[str, str] = {}
    parents = 0
    for key, value in scope.get("headers", ()):
        if key == b"traceparent":
            parents += 1
            carrier["traceparent"] = value.decode("latin-1")
        elif key == b"tracestate":  # repeated headers are one list (W3C Trace Context)
            text = value.decode("latin-1")
            carrier["tracestate"] = f"{carrier['tracestate']},{text}" if "tracestate" in carrier else text
    if parents > 1:  # W3C Trace Context: more than one traceparent is invalid, as is the tracestate it carries
        carrier.clear()
    # An invalid traceparent leaves the context empty: a new trace, never an error.
    parent = _PROPAGATOR.extract(carrier) if carrier else otel_context.Context()
    method = str(scope.get("method", ""))
    attributes = {"http.request.method": method, "url.path": str(scope.get("path", ""))}
    if route is not None:
        attributes["http.route"] = route
    span = tracer.start_span(f"{method} {route}" if route else method, context=parent, kind=SpanKind.SERVER,
                             attributes=attributes)
    return ServerSpan(span, otel_context.attach(trace.set_span_in_context(span, parent)))


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child of the current span for a stage of the request (``tokenize``); a no-op when tracing is off or
    the request is not recorded (sampled out, or no request at all)."""
    tracer = _tracer
    if tracer is None or not trace.get_current_span().is_recording():
        return _NO_SPAN
    return _stage(tracer, name)


@contextlib.contextmanager
def _stage(tracer: trace.Tracer, name: str) -> Iterator[trace.Span]:
    # The exception's type only: its message may quote a client's input, which stays out of traces as it
    # stays out of logs.
    with tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as stage:
        try:
            yield stage
        except Exception as exc:
            stage.set_attribute("error.type", type(exc).__name__)
            stage.set_status(StatusCode.ERROR)
            raise


def queued() -> QueueTrace | None:
    """At the enqueue of the current request's items: what its ``queue`` and ``inference`` spans need;
    None when tracing is off or the request is not recorded."""
    tracer = _tracer
    if tracer is None:
        return None
    request = trace.get_current_span()
    if not request.is_recording():
        return None
    return QueueTrace(tracer, request.get_span_context(), otel_context.get_current(), time.time_ns())


class QueueTrace:
    """One request's wait in the queue and the batches that ran it (core/outcomes.py Ticket ``trace``).

    Its spans are made after the fact, on the event loop, with the times the worker measured: the worker
    never touches a request's spans.
    """

    __slots__ = ("tracer", "request", "parent", "enqueued_ns", "waited")

    def __init__(self, tracer: trace.Tracer, request: SpanContext, parent: otel_context.Context,
                 enqueued_ns: int) -> None:
        self.tracer = tracer
        self.request = request  # the request span's context: what a batch links to
        self.parent = parent
        self.enqueued_ns = enqueued_ns
        self.waited = False  # the queue span is made (a batch started, or the request was answered)

    def ran_in(self, batch: BatchSpan) -> None:
        """A batch computed some of the request's items: the wait ends at its start (the first batch's)."""
        if not self.waited:
            self.waited = True
            self.tracer.start_span("queue", context=self.parent, start_time=self.enqueued_ns).end(batch.start_ns)
        ctx = batch.context
        self.tracer.start_span(
            "inference", context=self.parent, start_time=batch.start_ns, links=[Link(ctx)],
            attributes={"inferd.batch.trace_id": format_trace_id(ctx.trace_id),
                        "inferd.batch.span_id": format_span_id(ctx.span_id), "inferd.batch.size": batch.size},
        ).end(batch.end_ns)

    def answered(self, error: Any = None) -> None:
        """The request was answered: a wait no batch ended (a deadline, a drain, a refusal) ends now."""
        if self.waited:
            return
        self.waited = True
        wait = self.tracer.start_span("queue", context=self.parent, start_time=self.enqueued_ns)
        if error is not None:
            wait.set_attribute("error.type", str(getattr(error, "kind", type(error).__name__)))
            wait.set_status(StatusCode.ERROR)
        wait.end()


# -- the batch's span (worker thread) ------------------------------------------------------------------


class BatchSpan:
    """A batch's span, made on the worker thread, linked to the span of each request it serves."""

    __slots__ = ("span", "context", "start_ns", "end_ns", "size", "trace_ids")

    def __init__(self, span: trace.Span, start_ns: int, trace_ids: list[str]) -> None:
        self.span = span
        self.context = span.get_span_context()
        self.start_ns = self.end_ns = start_ns
        self.size = 0
        self.trace_ids = trace_ids  # the requests' traces, for the batch's log line

    @property
    def trace_id(self) -> str:
        return format_trace_id(self.context.trace_id)

    def end(self, *, size: int, padded_tokens: int, tokens: int, failed: int, model: str, version: str) -> None:
        self.size = size
        self.span.set_attributes({"inferd.batch.size": size, "inferd.batch.padded_tokens": padded_tokens,
                                  "inferd.batch.tokens": tokens, "inferd.model.name": model,
                                  "inferd.model.version": version})
        if failed:
            self.span.set_attribute("inferd.batch.failed", failed)
            self.span.set_status(StatusCode.ERROR)
        self.end_ns = time.time_ns()
        self.span.end(self.end_ns)


def start_batch(items: Iterable[Any]) -> BatchSpan | None:
    """Start the span of a batch of work items about to run; None when tracing is off or none of their
    requests is recorded (the cost on the worker thread when off: this test)."""
    tracer = _tracer
    if tracer is None:
        return None
    requests: dict[int, list[Any]] = {}
    for item in items:
        queue = item.ticket.trace
        if queue is not None:
            entry = requests.setdefault(id(queue), [queue.request, 0])
            entry[1] += 1
    if not requests:
        return None
    links = [Link(ctx, {"inferd.items": n}) for ctx, n in requests.values()]
    start_ns = time.time_ns()
    # The root of its own trace (an empty context: nothing is current on the worker thread anyway).
    batch = tracer.start_span("batch", context=otel_context.Context(), links=links, start_time=start_ns)
    return BatchSpan(batch, start_ns, [format_trace_id(ctx.trace_id) for ctx, _ in requests.values()])
