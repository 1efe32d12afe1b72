"""The one error shape: ``{"error": {"message", "type", "code", "param"}}``, request id in a header.

Also the one table that says how each kind of engine refusal is answered over HTTP (``KINDS``): status,
Retry-After, default code and the reason it is counted under in ``inferd_requests_rejected_total``; and, for
the wire families with an error shape of their own, the table from a kind to their name for it (``TEI_TYPES``).
A refusal carries its kind from the core to the wire: no family reads a kind back from a status.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from inferd.core.errors import ClientGone, EngineError, Kind

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "overloaded_error",
    504: "timeout_error",
    507: "insufficient_storage_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        type_: str | None = None,
        kind: Kind | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.type = type_ or _TYPES.get(status, "server_error")
        # The refusal's kind, for the families that name it in their own words (TEI_TYPES). None: the HTTP layer
        # refused the request as sent (its JSON, its fields), which those families answer as an invalid input.
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Answer:
    """How one kind of refusal is answered: ``code`` unless the refusal names a more precise one, and the
    rejection reason it is counted under (None: not a rejection the client caused or can act on by waiting)."""

    status: int
    code: str
    retry_after: int | None = None
    reason: str | None = None


KINDS: dict[Kind, Answer] = {
    Kind.INVALID_INPUT: Answer(422, "invalid_value", reason="invalid"),
    Kind.TOO_LONG: Answer(422, "text_too_long", reason="too_long"),
    Kind.WRONG_TASK: Answer(404, "wrong_task"),
    Kind.MODEL_NOT_FOUND: Answer(404, "model_not_found"),
    Kind.NOT_READY: Answer(503, "model_not_ready", retry_after=1, reason="not_ready"),
    # A failed load is not fixed by retrying at once: clients wait longer.
    Kind.MODEL_FAILED: Answer(503, "model_failed", retry_after=5, reason="not_ready"),
    Kind.MODEL_UNLOADED: Answer(503, "model_unloaded", retry_after=1),
    Kind.WORKER_DEAD: Answer(503, "worker_dead", retry_after=5),
    Kind.OVERLOADED: Answer(503, "queue_full", retry_after=1, reason="overloaded"),
    Kind.RATE_LIMITED: Answer(429, "rate_limit_exceeded", retry_after=1, reason="rate_limited"),
    Kind.CONFLICT: Answer(409, "conflict"),
    Kind.DRAINING: Answer(503, "draining", retry_after=1, reason="draining"),
    Kind.DEADLINE: Answer(504, "deadline_exceeded", reason="deadline"),
    Kind.OOM: Answer(507, "out_of_memory", reason="oom"),
    Kind.FAILED: Answer(500, "inference_error"),
}

# text-embeddings-inference's ``error_type`` for each kind (its router/src/lib.rs ErrorType): the input's fault is
# ``validation`` (``empty`` for an empty input or text, EMPTY_CODES), a model that cannot answer now is
# ``unhealthy``, a full queue or a deadline that passed in it ``overloaded``; a route of another task is TEI's 424
# "model is not a ... model", a ``backend`` error, as are a batch that failed and one out of memory.
TEI_TYPES: dict[Kind, str] = {
    Kind.INVALID_INPUT: "validation",
    Kind.TOO_LONG: "validation",
    Kind.WRONG_TASK: "backend",
    Kind.MODEL_NOT_FOUND: "validation",
    Kind.NOT_READY: "unhealthy",
    Kind.MODEL_FAILED: "unhealthy",
    Kind.MODEL_UNLOADED: "unhealthy",
    Kind.WORKER_DEAD: "unhealthy",
    Kind.OVERLOADED: "overloaded",
    Kind.RATE_LIMITED: "overloaded",
    Kind.CONFLICT: "validation",
    Kind.DRAINING: "unhealthy",
    Kind.DEADLINE: "overloaded",
    Kind.OOM: "backend",
    Kind.FAILED: "backend",
}
# The codes of an input that is empty (a text, a list): TEI's ``empty`` rather than ``validation``.
EMPTY_CODES = frozenset({"empty_string", "empty_input"})


def tei_type(exc: APIError) -> str:
    """TEI's ``error_type`` for a refusal: its kind's, ``empty`` for an empty input."""
    kind = exc.kind or Kind.INVALID_INPUT
    if kind is Kind.INVALID_INPUT and exc.code in EMPTY_CODES:
        return "empty"
    return TEI_TYPES[kind]


def refusal(kind: Kind, message: str, code: str | None = None, param: str | None = None) -> APIError:
    """A refusal the HTTP layer makes itself, answered as its kind is (KINDS: status, Retry-After, code)."""
    answer = KINDS[kind]
    headers = {"Retry-After": str(answer.retry_after)} if answer.retry_after else None
    return APIError(answer.status, message, code or answer.code, param, headers=headers, kind=kind)


@dataclass(frozen=True, slots=True)
class Names:
    """How one route names what the engine refuses, in its own request's terms: ``inputs`` is the field holding
    the inputs (input i is ``inputs[i]`` when ``listed``, the field itself when one value was sent), ``query``
    a pair's query (``{i}`` is the pair's index: ``texts[{i}][0]``; a shared query is just ``query``), and
    ``fields`` the engine's other fields by the route's names (Cohere's ``dimensions`` is ``output_dimension``)."""

    inputs: str
    listed: bool = True
    query: str = "query"
    fields: Mapping[str, str] = field(default_factory=dict)

    def param(self, exc: EngineError) -> str:
        if exc.field == "query" and exc.index is not None:
            return self.query.format(i=exc.index)
        if exc.field is not None:
            return self.fields.get(exc.field, exc.field)
        return f"{self.inputs}[{exc.index}]" if exc.index is not None and self.listed else self.inputs


def engine_refusal(exc: EngineError, names: Names, metrics: Any = None) -> APIError:
    """An engine refusal in the error shape (its kind's status, code and Retry-After: KINDS), counted under its
    reason. Only a 422 names the inputs' field; another status names a field only when the refusal is about
    one (``model``: a model not served)."""
    answer = KINDS[exc.kind]
    if metrics is not None and answer.reason is not None:
        metrics.rejected.labels(answer.reason).inc()
    headers = {"Retry-After": str(answer.retry_after)} if answer.retry_after else None
    if exc.retry_after is not None:
        # Whole seconds for Retry-After (RFC 9110); OpenAI's SDK reads retry-after-ms first, to the millisecond.
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after))),
                   "retry-after-ms": str(max(1, math.ceil(exc.retry_after * 1000)))}
    code = exc.code or answer.code
    if answer.status != 422:
        param = None if exc.field is None else names.fields.get(exc.field, exc.field)
        return APIError(answer.status, exc.message, code, param, headers=headers, kind=exc.kind)
    param = names.param(exc)
    return APIError(answer.status, f"{param}: {exc.message}", code, param, headers=headers, kind=exc.kind)


def error_body(status: int, message: str, code: str, param: str | None = None,
               type_: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_ or _TYPES.get(status, "server_error"),
                   "code": code, "param": param}}
    )


def error_response(exc: APIError) -> Response:
    return Response(
        error_body(exc.status, exc.message, exc.code, exc.param, exc.type),
        status_code=exc.status,
        headers=exc.headers,
        media_type="application/json",
    )


def _validation_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _validation_param(tuple(first.get("loc", ())))
        return error_response(APIError(422, f"{param or 'request'}: {first['msg']}", "invalid_value", param))

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(APIError(exc.status_code, str(exc.detail), code, headers=exc.headers))

    async def client_gone(_: Request, exc: Exception) -> Response:
        # nginx's "client closed request": nobody reads it, but the access log and the metrics count it.
        return Response(status_code=499)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
