"""Pure ASGI middleware: request context (id, timing headers, access log, metrics, trace) and the body limit.

Pure ASGI rather than BaseHTTPMiddleware, which hides client disconnects and buffers responses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import time
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.api.errors import APIError, error_body
from inferd.utils import tracing
from inferd.utils.logger import request_id_var
from inferd.utils.metrics import Metrics

log = logging.getLogger(__name__)
access_log = logging.getLogger("inferd.access")

# Request ids: 128 random bits from a generator of this process's own, seeded from the OS at import and again in a
# forked child, so ids differ across workers without a system call per request (uuid4 asks the kernel each time).
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_request_id() -> str:
    return f"{_ids.getrandbits(128):032x}"


_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# Why the connection protocol ended a request the app was still reading, and the status it answered
# (inferd.server.http writes the answer; the app only sees the client go). Anything else gone is 499.
ABORT_STATUS = {"body_timeout": 408, "shutdown": 503}
CLIENT_CLOSED = 499  # nginx's "client closed request": counted apart from the server's own errors
# Probes and scrapes, every few seconds from every load balancer and Prometheus: never traced (the Open Inference
# Protocol's probes and SageMaker's /ping are probes too).
UNTRACED = frozenset({"/health", "/health/live", "/health/ready", "/metrics", "/v2/health/live", "/v2/health/ready",
                      "/ping"})


# The scope's key for a callable giving more response headers from the time the response starts (a tenant's
# rate-limit headers: api/security.py require_tenant).
EXTRA_HEADERS = "inferd.headers"


def context(scope: Scope) -> dict[str, Any]:
    """The per-request dict routes fill (stage timings, version) for headers and the access log."""
    return scope.setdefault("inferd", {})


class RequestContextMiddleware:
    """``paths`` are the app's routes (api/app.py ``route_paths``): metric labels as they are; any other path
    is one label, "other", so 404 scans cannot explode the series."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: frozenset[str], access: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths
        self.access = access
        # The request counter's and histogram's series by (endpoint, status, model), looked up once: prometheus'
        # labels() validates, converts and locks on every call. Bounded as the labels are (route paths, statuses,
        # configured models), and those two families never drop a series.
        self._series: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied = _header(scope, b"x-request-id")
        rid = supplied if supplied and _SAFE_ID.match(supplied) else new_request_id()
        token = request_id_var.set(rid)
        started = time.perf_counter()
        ctx = context(scope)
        ctx["request_id"] = rid  # for an answer the connection protocol writes itself (ABORT_STATUS)
        path = scope.get("path", "")
        # None when tracing is off (utils/tracing.py): then this is the only cost of tracing here.
        span = None if path in UNTRACED else tracing.server_span(scope, path if path in self.paths else None)
        if span is not None:
            ctx["trace_id"], ctx["span_id"] = span.ids
        status = [500]
        response_started = [False]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_started[0] = True
                status[0] = message["status"]
                ours = [("X-Request-ID", rid), ("X-Process-Time", f"{(time.perf_counter() - started) * 1e3:.3f}")]
                if "queue_ms" in ctx:
                    ours.append(("X-Queue-Time", f"{ctx['queue_ms']:.3f}"))
                    ours.append(("X-Inference-Time", f"{ctx['inference_ms']:.3f}"))
                if "version" in ctx:
                    ours.append(("X-Model-Version", str(ctx["version"])))
                if "runtime" in ctx:
                    ours.append(("X-Inferd-Runtime", str(ctx["runtime"])))
                extra = scope.get(EXTRA_HEADERS)
                if extra is not None:
                    ours += extra(time.monotonic()).items()
                set_headers(message, ours)
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except ClientDisconnect:
            # The client went before its body arrived (or the protocol ended the request, see
            # ABORT_STATUS): nothing is wrong with the server, so no traceback and no 5xx.
            if not response_started[0]:
                status[0] = ABORT_STATUS.get(ctx.get("abort", ""), CLIENT_CLOSED)
        except asyncio.CancelledError:
            # Only a shutdown cancels a request task (past its grace); answered here, not by uvicorn's
            # text/plain 500 and traceback. Not re-raised: this is the task's outermost frame.
            log.warning("request cancelled: the server is stopping")
            if not response_started[0]:
                await _send_error(send_with_headers, APIError(
                    503, "the server is shutting down; retry on another instance", "draining",
                    headers={"Retry-After": "1"}))
        except Exception:
            log.exception("unhandled error")
            if not response_started[0]:
                await _send_error(send_with_headers, APIError(
                    500, "internal server error; quote the request id when reporting it", "internal_error"),
                    close=False)
        finally:
            elapsed = time.perf_counter() - started
            # A route with parameters (/v2/models/{name}/infer) by its template, which routing left in the scope.
            template = getattr(scope.get("route"), "path_format", None)
            endpoint = path if path in self.paths else template if template in self.paths else "other"
            key = (endpoint, str(status[0]), str(ctx.get("model", "")))
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = (self.metrics.requests.labels(*key),
                                              self.metrics.request_duration.labels(key[0], key[2]))
            series[0].inc()
            series[1].observe(elapsed)
            # The line's fields are built only when it is written (the log level may leave it out).
            if self.access and access_log.isEnabledFor(logging.INFO):
                access_log.info(
                    "%s %s %d", scope.get("method"), path, status[0],
                    extra={"endpoint": endpoint, "status": status[0], "duration_ms": round(elapsed * 1e3, 3),
                           **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in ctx.items()}})
            if span is not None:
                span.end(status[0], ctx)
            request_id_var.reset(token)


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes", "body_too_large")


class BodyLimitMiddleware:
    """Refuse bodies over the limit: by Content-Length up front, and by counting (chunked bodies). ``larger``
    names paths with a larger limit of their own (the routes that take long documents: api/documents.py, which
    holds a body that asks for no chunking to ``max_bytes`` itself)."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope["path"], self.max_bytes)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            exc = BodyTooLarge(limit)
            await _send_error(send, exc)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)


async def _send_error(send: Send, exc: APIError, close: bool = True) -> None:
    body = error_body(exc.status, exc.message, exc.code, exc.param, exc.type)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def overloaded(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer past ``server.limit_concurrency`` (inferd.server.http routes requests here)."""
    await _send_error(send, APIError(503, "the server is at its connection limit (server.limit_concurrency); "
                                     "retry shortly", "overloaded", headers={"Retry-After": "1"}))


def set_headers(message: Message, headers: list[tuple[str, str]]) -> None:
    """Set response headers on an ``http.response.start`` message as starlette's MutableHeaders does one by one (a
    name already there replaced in place, its repeats dropped; a new one appended), in one pass for the common case
    where none is there yet: MutableHeaders scans the whole list for every header set."""
    raw = message["headers"] = list(message.get("headers", ()))
    pairs = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    names = {name for name, _ in pairs}
    if len(names) == len(pairs) and not any(name in names for name, _ in raw):
        raw += pairs
        return
    mutable = MutableHeaders(scope=message)
    for name, value in headers:
        mutable[name] = value


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None
