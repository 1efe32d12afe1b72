"""One batch input file's lines: split, parsed and validated for an endpoint, and run through the app itself.

Interface (the server's runner, jobs/runner.py, and ``inferd batch`` build on it):

- ``ENDPOINTS``: the endpoints a batch may name, each an ``Endpoint`` (its path, the body schema its online route
  validates with, and the body's lowest priority in that route's own terms).
- ``endpoint_of(path) -> Endpoint``: raises ``FileRefused`` (code ``unknown_endpoint``) for any other path.
- ``split(data) -> list[bytes]``: the file's lines (``\\n`` or ``\\r\\n``), blank ones kept as blank so a line's
  number is its place in the file (0-based).
- ``check_file(data, max_line_bytes) -> int``: what refuses a whole file (``FileRefused``: not UTF-8, a line over
  the limit, no line at all, not JSONL: no line is a JSON object); returns the number of lines that are not blank.
- ``parse(raw, number, endpoint) -> Line | Record``: one line as ``{custom_id, method, url, body}`` checked (method
  POST, url equal to the batch's endpoint, body valid under the online route's schema); a bad line is a ``Record``
  (an error record naming what is wrong), never dropped. ``parse_all(raws, first, endpoint, job, duplicates)`` does
  a list (a chunk), refusing the lines ``duplicates_in(all_raws)`` names: a ``custom_id`` an earlier line has.
- ``LineRunner(app, in_flight).route_lines(lines, endpoint, tenant) -> list[Record]``: each line given to the app's
  own route for the endpoint (the route function a POST reaches: the same body parsing, validation and engine call,
  so a body equals what the online endpoint answers), ``in_flight`` at a time over every call so the scheduler packs
  them, each at the endpoint's lowest priority and the longest deadline, as ``tenant`` (the tenant a key check would
  have set).
- ``Record``: one output line in OpenAI's batch output shape, ``{"id", "custom_id", "response": {"status_code",
  "request_id", "body"}, "error"}``; ``ok`` says which file it belongs to (output or error), ``retry`` that the
  answer was "not now" (429, 503, 504): the runner runs that line again rather than record it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Scope

from inferd.api import cohere, inferd_encode, inferd_routes, openai
from inferd.api.client_schemas import CohereRerankRequest
from inferd.api.errors import APIError, error_response
from inferd.api.middleware import new_request_id
from inferd.api.schemas import ClassifyRequest, EmbeddingsRequest, EncodeRequest
from inferd.core.errors import excerpt
from inferd.core.request import MAX_TIMEOUT_MS
from inferd.core.tenant import Tenant, job_line
from inferd.core.tenants import current_tenant
from inferd.utils.logger import request_id_var

log = logging.getLogger(__name__)

# Answers that mean "not now", not "this line is wrong": the line runs again later.
RETRY_STATUSES = frozenset({429, 503, 504})
MAX_CUSTOM_ID = 512


class FileRefused(Exception):
    """A whole file (or endpoint) refused: nothing of it runs; ``code`` and ``param`` as the error shape's."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An endpoint a batch may name: ``schema`` is its online route's body, ``lowest`` the body's priority that runs
    below every online request (inferd's -100; Cohere's rerank counts the other way: 100), ``route`` the route."""

    path: str
    schema: type[BaseModel]
    lowest: int
    route: Callable[[Request], Awaitable[Response]]  # the online route's own function


ENDPOINTS: dict[str, Endpoint] = {e.path: e for e in (
    Endpoint("/v1/embeddings", EmbeddingsRequest, -100, openai.embeddings),
    Endpoint("/v1/rerank", CohereRerankRequest, 100, cohere.rerank),
    Endpoint("/v1/encode", EncodeRequest, -100, inferd_encode.encode),
    Endpoint("/v1/classify", ClassifyRequest, -100, inferd_routes.classify),
)}


def endpoint_of(path: str) -> Endpoint:
    found = ENDPOINTS.get(path)
    if found is None:
        raise FileRefused(f"endpoint {excerpt(str(path))!r} is not one a batch may run; use one of "
                          f"{sorted(ENDPOINTS)}", "unknown_endpoint", "endpoint")
    return found


@dataclass(frozen=True, slots=True)
class Line:
    """A valid line: its place in the file, its custom_id and its body (as sent)."""

    number: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Record:
    """One output or error line: ``data`` is its JSON (no newline)."""

    number: int
    custom_id: str | None
    ok: bool
    data: bytes
    retry: bool = False
    status: int | None = None  # the HTTP status a line that ran was answered with


def split(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline ends the last line; it does not start another
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def check_file(data: bytes, max_line_bytes: int) -> int:
    """The checks of a whole file (FileRefused); the number of lines that are not blank."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRefused(f"the file is not UTF-8 text (byte {exc.start}); send JSONL", "invalid_file") from None
    count = 0
    objects = 0
    for number, raw in enumerate(split(data)):
        if len(raw) > max_line_bytes:
            raise FileRefused(f"line {number + 1} is {len(raw)} bytes; at most {max_line_bytes} (jobs.max_line_bytes)",
                              "line_too_large")
        if raw.strip():
            count += 1
            if objects == 0 and raw.lstrip().startswith(b"{"):
                with contextlib.suppress(orjson.JSONDecodeError):
                    objects += isinstance(orjson.loads(raw), dict)
    if count == 0:
        raise FileRefused("the file has no lines; send one JSON object per line", "empty_file")
    if objects == 0:
        raise FileRefused("the file is not JSONL: no line is a JSON object", "invalid_file")
    return count


def _record(number: int, custom_id: str | None, status: int | None, body: Any, request_id: str | None,
            error: dict[str, str] | None, job: str) -> Record:
    # The id is the job's and the line's: a line run twice (a chunk redone after a crash) has the same id.
    rid = "batch_req_" + hashlib.blake2b(f"{job}:{number}".encode(), digest_size=12).hexdigest()
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    data = orjson.dumps({"id": rid, "custom_id": custom_id, "response": response, "error": error})
    return Record(number, custom_id, status == 200, data, status in RETRY_STATUSES, status)


def bad(number: int, custom_id: str | None, code: str, message: str, job: str = "") -> Record:
    """The error record of a line that never ran."""
    return _record(number, custom_id, None, None, None, {"code": code, "message": f"line {number + 1}: {message}"},
                   job)


def _checked_body(body: Any, schema: type[BaseModel]) -> str | None:
    """None when ``body`` passes the online route's schema; else the refusal, worded as api/bodies.py words it."""
    if not isinstance(body, dict):
        return "body: must be a JSON object"
    unknown = next((key for key in body if key not in schema.model_fields), None)
    if unknown is not None:
        return f"body.{excerpt(unknown)}: unknown field"
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        return f"body.{excerpt('.'.join(str(p) for p in err['loc']))}: {err['msg']}"
    return None


def parse(raw: bytes, number: int, endpoint: Endpoint, job: str = "") -> Line | Record | None:
    """One line: a Line, an error Record, or None for a blank line (no request; not counted)."""
    if not raw.strip():
        return None
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return bad(number, None, "invalid_json", f"not valid JSON: {exc}", job)
    if not isinstance(item, dict):
        return bad(number, None, "invalid_json", "must be a JSON object", job)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return bad(number, None, "invalid_custom_id", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} "
                   "characters", job)
    unknown = next((k for k in item if k not in ("custom_id", "method", "url", "body")), None)
    if unknown is not None:
        return bad(number, custom_id, "invalid_value", f"{excerpt(str(unknown))}: unknown field", job)
    if item.get("method") != "POST":
        return bad(number, custom_id, "invalid_method", "method must be \"POST\"", job)
    if item.get("url") != endpoint.path:
        return bad(number, custom_id, "invalid_url", f"url must be the batch's endpoint, {endpoint.path!r}", job)
    refused = _checked_body(item.get("body"), endpoint.schema)
    if refused is not None:
        return bad(number, custom_id, "invalid_value", refused, job)
    return Line(number, custom_id, item["body"])


def parse_all(raws: Sequence[bytes], first: int, endpoint: Endpoint, job: str = "",
              duplicates: frozenset[int] = frozenset()) -> tuple[list[Line], list[Record]]:
    """Lines ``first``, ``first + 1``, ...: the valid ones and an error record per bad one; a line whose number is
    in ``duplicates`` (``duplicates_in``: its custom_id is an earlier line's) is a bad one."""
    lines: list[Line] = []
    records: list[Record] = []
    for offset, raw in enumerate(raws):
        parsed = parse(raw, first + offset, endpoint, job)
        if isinstance(parsed, Line) and parsed.number in duplicates:
            records.append(bad(parsed.number, parsed.custom_id, "duplicate_custom_id",
                               "custom_id is an earlier line's too; each must be unique", job))
        elif isinstance(parsed, Line):
            lines.append(parsed)
        elif parsed is not None:
            records.append(parsed)
    return lines, records


def duplicates_in(raws: Sequence[bytes]) -> frozenset[int]:
    """The numbers of the lines whose custom_id an earlier line has (over the whole file: chunks parse apart)."""
    seen: set[Any] = set()
    found: set[int] = set()
    for number, raw in enumerate(raws):
        if not raw.strip():
            continue
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if isinstance(custom_id, str):
            if custom_id in seen:
                found.add(number)
            seen.add(custom_id)
    return frozenset(found)


class LineRunner:
    """Runs valid lines through the endpoints' own route functions (``Endpoint.route``: what a client's POST
    reaches), each given a request of ``app`` with the line's body, as the batch's owner. The HTTP client, the
    middleware and FastAPI's routing are left out (they were most of a line's cost: a tiny model ran 5x slower
    behind them); what the route answers is the same."""

    def __init__(self, app: Starlette, in_flight: int) -> None:
        """``in_flight``: lines given to the route at once, over every ``route_lines`` of this runner."""
        self.app = app
        self._room = asyncio.Semaphore(in_flight)

    async def route_lines(self, lines: Sequence[Line], endpoint: Endpoint, tenant: Tenant | None,
                          job: str = "") -> list[Record]:
        return list(await asyncio.gather(*(self._bounded(endpoint.route, line, endpoint, tenant, job)
                                           for line in lines)))

    async def _bounded(self, route: Callable[[Request], Awaitable[Response]], line: Line, endpoint: Endpoint,
                       tenant: Tenant | None, job: str) -> Record:
        async with self._room:
            return await self._one(route, line, endpoint, tenant, job)

    async def _one(self, route: Callable[[Request], Awaitable[Response]], line: Line, endpoint: Endpoint,
                   tenant: Tenant | None, job: str) -> Record:
        # Below every online request, and never past a deadline while online work goes first.
        body = orjson.dumps({**line.body, "priority": endpoint.lowest, "timeout_ms": MAX_TIMEOUT_MS})
        rid = new_request_id()
        # This line's own task (gather): what it sets is its own.
        request_id_var.set(rid)
        current_tenant.set(tenant)
        job_line.set(True)  # charged to its owner's token budget, not its requests in flight or per second
        scope: Scope = {"type": "http", "method": "POST", "path": endpoint.path, "raw_path": endpoint.path.encode(),
                        "query_string": b"", "headers": [(b"content-type", b"application/json")], "app": self.app,
                        "inferd": {"request_id": rid}, "http_version": "1.1", "scheme": "http", "root_path": "",
                        "client": None, "server": None}
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the batch never goes away as a client does
            raise AssertionError("unreachable")

        try:
            answer = await route(Request(scope, receive))
        except APIError as exc:
            answer = error_response(exc)
        except Exception:
            log.exception("batch %s: line %d failed", job, line.number)
            answer = error_response(APIError(500, "internal server error; quote the request id when reporting it",
                                             "internal_error"))
        status = answer.status_code
        payload: Any = orjson.loads(bytes(answer.body))
        error = None
        if status != 200:
            detail = payload.get("error") if isinstance(payload, dict) else None
            error = {"code": str(detail.get("code")) if isinstance(detail, dict) else "http_error",
                     "message": str(detail.get("message")) if isinstance(detail, dict) else ""}
        return _record(line.number, line.custom_id, status, payload, rid, error, job)
