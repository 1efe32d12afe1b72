"""JSON in and out: a request body parsed and validated against its schema, and a JSON response.

Every route that reads a body (inference and admin) reads it here, so each refusal of a body (empty, not
JSON, not an object, an unknown or invalid field) has one wording and one error shape.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from inferd.api.errors import APIError
from inferd.core.errors import excerpt

B = TypeVar("B", bound=BaseModel)


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    headers=headers, media_type="application/json")


def _decode(body: bytes, model: type[B], check: Callable[[B], None] | None) -> B:
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON (or not UTF-8): {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_json")
    # Unknown keys first, in one pass: pydantic would build an error object for each of them (90,000 keys
    # in a 1 MB body held the event loop for half a second) while only the first is ever reported.
    fields = model.model_fields
    unknown = next((key for key in data if key not in fields), None)
    if unknown is not None:
        # An unknown field's name is client input: echo only an excerpt of it.
        param = excerpt(unknown)
        raise APIError(422, f"{param}: unknown field", "invalid_value", param)
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        param = excerpt(".".join(str(p) for p in err["loc"])) or None
        raise APIError(422, f"{param}: {err['msg']}", "invalid_value", param) from None
    if check is not None:
        check(parsed)
    return parsed


async def read_body(request: Request, model: type[B], check: Callable[[B], None] | None = None) -> B:
    """Parse and validate a JSON body; ``check`` adds the route's own cheap checks (counts, types).

    All of it runs with the garbage collector paused: 1 MB of ``[],`` is 300,000 lists, and collections
    triggered while they are built (and walked again while they are alive) held the event loop for over a
    second. A refused body is dropped before the collector resumes, so reference counting frees it alone;
    an accepted one has passed ``check``, so it is small.
    """
    body = await request.body()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _decode(body, model, check)
    except APIError as exc:
        # The traceback and the chained exception hold the decoding frame, and with it the parsed data.
        exc.__context__ = exc.__cause__ = None
        raise exc.with_traceback(None) from None
    finally:
        if enabled:
            gc.enable()
