"""The one error shape: ``{"error": {"message", "type", "code", "param"}}``, request id in a header."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.type = type_ or _TYPES.get(status, "server_error")


def excerpt(text: str, limit: int = 40) -> str:
    """A short, safe excerpt of user input for error messages (never the whole input)."""
    return text if len(text) <= limit else text[:limit] + "…"


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

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
