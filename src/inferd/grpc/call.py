"""What every RPC shares with every HTTP request: the key and its tenant, the deadline, the request id, the access
log line, the request metrics and the trace span; and the one engine call (api/engine_call.py's, as the routes make
it: the request built under the server's limits, its refusals named by api/errors.py Names, then as a status).

The call's metadata carries what HTTP carries in headers, by the same names: ``authorization: Bearer <key>``
(api/security.py's rules: a tenant's key, or none on an open server), ``x-request-id``, ``traceparent``,
``x-routing-key``; and inferd's own request fields, which TEI's messages have no room for: ``x-model`` (a served
model's name, ``name@version`` to pin one), ``x-priority`` (an integer, higher first). The gRPC deadline becomes the
request's ``timeout_ms``: work still queued when it passes is dropped and answered DEADLINE_EXCEEDED.

A stream is one RPC: one log line and one count when it ends, with the messages it carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from starlette.requests import Request

from inferd.api.errors import APIError, Names, engine_refusal
from inferd.api.middleware import context, new_request_id
from inferd.api.security import require_tenant
from inferd.api.services import Services, services_of
from inferd.core.errors import ClientGone, EngineError
from inferd.core.outcomes import TaskResult
from inferd.core.request import MAX_TIMEOUT_MS, InferenceRequest
from inferd.core.tenants import current_tenant
from inferd.grpc.status import Code, Refused, refused
from inferd.utils import tracing
from inferd.utils.logger import request_id_var

log = logging.getLogger(__name__)
access_log = logging.getLogger("inferd.access")

M = TypeVar("M")
R = TypeVar("R")

DEADLINE_MARGIN_MS = 20.0
# A status the server caused (a span's error, as a 5xx is HTTP's); the others are the client's.
_SERVER_FAULTS = frozenset({Code.INTERNAL, Code.UNKNOWN, Code.UNAVAILABLE, Code.DATA_LOSS, Code.UNIMPLEMENTED})


def deadline_ms(left_s: float) -> float:
    """The request's timeout for a call with ``left_s`` seconds to its deadline: a little less (a tenth, at most
    DEADLINE_MARGIN_MS), so the server's DEADLINE_EXCEEDED, which says where the time went, reaches the client
    before its own timer fires with none."""
    left = left_s * 1000.0
    return min(max(left - min(left / 10, DEADLINE_MARGIN_MS), 1.0), MAX_TIMEOUT_MS)


class Call:
    """One RPC as the engine and the log see it: ``request`` is its metadata as an HTTP request's headers, on the
    app (so the key check is api/security.py's own, and what reads the services of a request reads them), and
    ``ctx`` the context dict its log line and span are written from."""

    def __init__(self, app: Any, context_: grpc.aio.ServicerContext, method: str) -> None:
        self.s: Services = services_of(app)
        self.grpc, self.method = context_, method
        sent = [(m.key.encode("latin-1", "replace"), m.value.encode("latin-1", "replace"))
                for m in context_.invocation_metadata() or () if isinstance(m.value, str)]
        self.scope: dict[str, Any] = {"type": "http", "method": "POST", "path": method, "headers": sent,
                                      "app": app}
        self.request = Request(self.scope)
        self.ctx = context(self.scope)
        self.messages = 0

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)

    def options(self) -> dict[str, Any]:
        """The engine request's options the metadata and the deadline give (every RPC's)."""
        out: dict[str, Any] = {"tenant": current_tenant.get(), "routing_key": self.header("x-routing-key"),
                               "model": self.header("x-model") or None}
        priority = self.header("x-priority")
        if priority is not None:
            try:
                out["priority"] = int(priority)
            except ValueError:
                raise Refused(Code.INVALID_ARGUMENT, f"x-priority: must be an integer, not {priority[:40]!r}") \
                    from None
        left = self.grpc.time_remaining()
        if left is not None:
            if left <= 0:
                raise Refused(Code.DEADLINE_EXCEEDED, "the call's deadline passed before it was read")
            out["timeout_ms"] = deadline_ms(left)
        return out

    def build(self, inputs: Any, names: Names, **options: Any) -> InferenceRequest:
        """The engine's request (every model-free rule checked), its refusal in the request's terms."""
        try:
            return self.s.engine.request(inputs, **{**self.options(), **options})
        except EngineError as exc:
            raise engine_refusal(exc, names, self.s.metrics) from None

    async def ask_engine(self, request: InferenceRequest, names: Names) -> TaskResult:
        """The one engine call, as api/engine_call.py's ask_engine: the result's model, version and timings logged."""
        if self.s.settings.server.log_inputs:
            self.ctx["inputs"] = list(request.inputs)
        try:
            result = await self.s.engine.process(request)
        except EngineError as exc:
            if exc.model is not None:
                self.ctx["model"] = exc.model
            raise engine_refusal(exc, names, self.s.metrics) from None
        self.ctx.update(result.timings)
        self.ctx["model"], self.ctx["version"] = result.model, result.version
        # As HTTP's X-Model-Version and X-Inferd-Runtime headers, but trailing: the initial metadata left before
        # the engine answered (backend auto may switch runtimes between two calls). A stream's last answer says it.
        self.grpc.set_trailing_metadata((("x-model-version", str(result.version)),
                                         ("x-inferd-runtime", str(result.description.runtime))))
        self.ctx["tokens"] = self.ctx.get("tokens", 0) + result.prompt_tokens
        return result


async def _begin(app: Any, context_: grpc.aio.ServicerContext, method: str) -> tuple[Call, list[Any]]:
    call = Call(app, context_, method)
    s = call.s
    supplied = call.header("x-request-id")
    rid = supplied if supplied and 0 < len(supplied) <= 128 and supplied.isascii() else new_request_id()
    call.ctx["request_id"] = rid
    undo: list[Any] = [request_id_var.set(rid)]
    span = tracing.server_span(call.scope, method)
    call.ctx["_span"] = span
    if span is not None:
        call.ctx["trace_id"], call.ctx["span_id"] = span.ids
    await context_.send_initial_metadata((("x-request-id", rid),))
    require_tenant(call.request, s.tenancy, s.metrics)  # raises the 401 (counted) when no tenant's key is sent
    return call, undo


def _end(call: Call, code: Code, started: float, undo: list[Any]) -> None:
    elapsed = time.perf_counter() - started
    span = call.ctx.pop("_span", None)
    model = str(call.ctx.get("model", ""))
    metrics = call.s.metrics
    metrics.requests.labels(call.method, code.name, model).inc()
    metrics.request_duration.labels(call.method, model).observe(elapsed)
    if call.messages:
        call.ctx["messages"] = call.messages
    if call.s.settings.server.access_log:
        access_log.info("gRPC %s %s", call.method, code.name, extra={
            "endpoint": call.method, "status": code.name, "duration_ms": round(elapsed * 1e3, 3),
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in call.ctx.items()}})
    if span is not None:
        span.span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.end(500 if code in _SERVER_FAULTS else 400 if code is not Code.OK else 200, call.ctx)
    for token in reversed(undo):
        # A stream its client left is closed by the event loop's finaliser, in a context of its own: the request
        # id was set in the call's, which is gone with it, so there is nothing to reset.
        with contextlib.suppress(ValueError):
            request_id_var.reset(token)


def _refusal(exc: BaseException) -> Refused:
    if isinstance(exc, Refused):
        return exc
    if isinstance(exc, APIError):
        return refused(exc)
    if isinstance(exc, EngineError):
        return refused(engine_refusal(exc, Names("inputs")))
    if isinstance(exc, ClientGone):
        return Refused(Code.CANCELLED, "the client went away")
    log.exception("unhandled error in an RPC", exc_info=exc)
    return Refused(Code.INTERNAL, "internal server error; quote the request id when reporting it")


async def _abort(context_: grpc.aio.ServicerContext, refusal: Refused) -> None:
    if refusal.trailers:
        context_.set_trailing_metadata(refusal.trailers)
    await context_.abort(refusal.code, refusal.message)


Unary = Callable[[Any, M, grpc.aio.ServicerContext], Awaitable[R]]
Handler = Callable[[Any, Call, M], Awaitable[R]]


def unary(method: str) -> Callable[[Handler[M, R]], Unary[M, R]]:
    """A servicer method answering once (a unary RPC, or a client stream's one answer), as a Call."""

    def wrap(handler: Handler[M, R]) -> Unary[M, R]:
        @functools.wraps(handler)
        async def rpc(self: Any, message: M, context_: grpc.aio.ServicerContext) -> R:
            started, code, undo = time.perf_counter(), Code.OK, []
            call: Call | None = None
            try:
                call, undo = await _begin(self.app, context_, method)
                return await handler(self, call, message)
            except asyncio.CancelledError:
                code = Code.CANCELLED  # the client went (or the server stopped past its grace)
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                refusal = _refusal(exc)
                code = refusal.code
                await _abort(context_, refusal)
                raise AssertionError("abort returns by raising") from None
            finally:
                if call is not None:
                    _end(call, code, started, undo)
        return rpc
    return wrap


StreamHandler = Callable[[Any, Call, M], AsyncIterator[R]]


def streaming(method: str) -> Callable[[StreamHandler[M, R]], Callable[[Any, M, grpc.aio.ServicerContext],
                                                                           AsyncIterator[R]]]:
    """A servicer method answering with a stream (server or bidirectional streaming), as a Call."""

    def wrap(handler: StreamHandler[M, R]) -> Callable[[Any, M, grpc.aio.ServicerContext], AsyncIterator[R]]:
        @functools.wraps(handler)
        async def rpc(self: Any, message: M, context_: grpc.aio.ServicerContext) -> AsyncIterator[R]:
            started, code, undo = time.perf_counter(), Code.OK, []
            call: Call | None = None
            try:
                call, undo = await _begin(self.app, context_, method)
                async for answer in handler(self, call, message):
                    yield answer
            except (asyncio.CancelledError, GeneratorExit):
                # GeneratorExit: the client went while grpcio was sending an answer, and grpcio left this generator
                # at its yield for the event loop to close.
                code = Code.CANCELLED
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                refusal = _refusal(exc)
                code = refusal.code
                await _abort(context_, refusal)
            finally:
                if call is not None:
                    _end(call, code, started, undo)
        return rpc
    return wrap

