"""OpenAI's Files API for batch jobs, as the ``openai`` client calls it: ``POST /v1/files`` (multipart: ``file``,
``purpose`` ``batch``), ``GET /v1/files`` (newest first; ``after``, ``limit``, ``purpose``), ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content`` and ``DELETE /v1/files/{id}``.

A file is its owner's (the tenant whose key uploaded it; without tenants, the server's one owner): another tenant's
file is answered 404, as one that does not exist. An input file is checked whole as it arrives (jobs/lines.py
check_file: UTF-8, JSONL, no line over ``jobs.max_line_bytes``, not empty); each line is checked when it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from inferd.api import uploads
from inferd.api.answers import raw_body, responses
from inferd.api.bodies import json_response
from inferd.api.errors import APIError
from inferd.api.services import inference_auth
from inferd.core.errors import excerpt
from inferd.core.tenants import current_tenant
from inferd.jobs.files import new_id
from inferd.jobs.lines import FileRefused, check_file
from inferd.jobs.runner import JobRunner
from inferd.jobs.store import UnknownCursor

log = logging.getLogger(__name__)

files_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys: a tenant's own files

_OBJECT = raw_body("application/json", {"type": "object"})
_ERRORS = (400, 401, 404, 409, 413, 422)
# The purposes a file may be uploaded for: a batch's input (outputs are the server's own: batch_output).
PURPOSES = ("batch",)


def runner_of(app: Any) -> JobRunner | None:
    """The app's batch runner (api/app.py makes it; None with jobs.enabled off)."""
    found = app.state.jobs
    assert found is None or isinstance(found, JobRunner)
    return found


def runner(request: Request) -> JobRunner:
    jobs = runner_of(request.app)
    if jobs is None:
        raise APIError(404, "batch jobs are off on this server (jobs.enabled)", "not_found")
    return jobs


def owner() -> str:
    """Whose files and batches a request sees: its key's tenant ("" when the server has no keys)."""
    tenant = current_tenant.get()
    return tenant.name if tenant is not None else ""


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": int(row["expires_at"]) if row["expires_at"] else None, "status_details": None}


async def paged(after: str | None, listing: Callable[..., tuple[list[dict], bool]],
                *args: Any) -> tuple[list[dict], bool]:
    """A page of the store's ``listing`` (called with ``args``) after ``after``; a cursor that names none of the
    caller's objects (deleted, or never theirs) is a 400: an empty page would end a client's paging early without a
    word."""
    try:
        return await asyncio.to_thread(listing, *args)
    except UnknownCursor:
        raise APIError(400, f"after {excerpt(str(after))!r} names no object of yours (deleted since the last page?)",
                       "invalid_cursor", "after") from None


async def owned_file(request: Request, file_id: str) -> dict[str, Any]:
    row = await asyncio.to_thread(runner(request).store().file, file_id, owner())
    if row is None:
        raise APIError(404, f"no file {excerpt(file_id)!r}", "file_not_found", "file_id")
    return row


@files_router.post("/v1/files", responses=responses(_OBJECT, *_ERRORS))
async def upload(request: Request) -> Response:
    """A batch input file (multipart/form-data: ``file`` and ``purpose: batch``)."""
    jobs = runner(request)
    form = uploads.parts(await request.body(), request.headers.get("content-type", ""))
    purpose = form.get("purpose")
    if purpose is None or purpose.data.decode("utf-8", "replace") not in PURPOSES:
        raise APIError(400, f"purpose must be one of {list(PURPOSES)}", "invalid_purpose", "purpose")
    sent = form.get("file")
    if sent is None:
        raise APIError(400, "no file part: send the file as the multipart field 'file'", "missing_file", "file")
    settings = jobs.settings
    if len(sent.data) > settings.max_file_bytes:
        raise APIError(413, f"the file is {len(sent.data)} bytes; at most {settings.max_file_bytes} "
                       "(jobs.max_file_bytes)", "file_too_large", "file")
    lifetime = _lifetime(form, settings.expiry_s)
    try:
        lines = await asyncio.to_thread(check_file, sent.data, settings.max_line_bytes)
    except FileRefused as exc:
        raise APIError(400, exc.message, exc.code, exc.param or "file") from None
    if lines > settings.max_lines:
        raise APIError(400, f"the file has {lines} lines; at most {settings.max_lines} (jobs.max_lines)",
                       "too_many_lines", "file")
    file_id = new_id("file-")
    now = time.time()
    row = {"id": file_id, "owner": owner(), "purpose": "batch", "filename": (sent.filename or "file")[:512],
           "bytes": len(sent.data), "lines": lines, "created_at": now, "expires_at": now + lifetime}
    await asyncio.to_thread(jobs.files.write, file_id, sent.data)  # on disk before any row names it
    await asyncio.to_thread(jobs.store().add_file, row)
    log.info("file %s: uploaded (%d lines, %d bytes)", file_id, lines, len(sent.data), extra={"file": file_id})
    return json_response(file_object(row))


def _lifetime(form: dict[str, uploads.Part], default: float) -> float:
    """Seconds the file is kept: OpenAI's ``expires_after`` (anchor ``created_at``, 1 hour to 30 days, as the
    openai client sends it: ``expires_after[anchor]``, ``expires_after[seconds]``) up to ``jobs.expiry_s`` (every
    file's bound), else ``jobs.expiry_s``."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default
    if anchor is None or anchor.data != b"created_at":
        raise APIError(400, "expires_after.anchor must be 'created_at'", "invalid_value", "expires_after.anchor")
    text = b"" if seconds is None else seconds.data.strip()
    if not text.isdigit() or not 3600 <= int(text) <= 30 * 86400:
        raise APIError(400, "expires_after.seconds must be a whole number of seconds from 3600 (1 hour) to 2592000 "
                       "(30 days)", "invalid_value", "expires_after.seconds")
    return min(float(int(text)), default)


@files_router.get("/v1/files", responses=responses(_OBJECT, *_ERRORS))
async def list_files(request: Request, after: str | None = None, limit: int = Query(100, ge=1, le=10_000),
                     purpose: str | None = None, order: Literal["asc", "desc"] = "desc") -> Response:
    rows, more = await paged(after, runner(request).store().files, owner(), purpose, after, limit, order == "asc")
    data = [file_object(r) for r in rows]
    return json_response({"object": "list", "data": data, "has_more": more,
                          "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


@files_router.get("/v1/files/{file_id}", responses=responses(_OBJECT, *_ERRORS))
async def get_file(request: Request, file_id: str) -> Response:
    return json_response(file_object(await owned_file(request, file_id)))


@files_router.get("/v1/files/{file_id}/content",
                  responses=responses(raw_body("application/octet-stream", {"type": "string"}), *_ERRORS))
async def file_content(request: Request, file_id: str) -> Response:
    row = await owned_file(request, file_id)
    data = await asyncio.to_thread(runner(request).files.read, row["id"])
    return Response(data, media_type="application/octet-stream")


@files_router.delete("/v1/files/{file_id}", responses=responses(_OBJECT, *_ERRORS))
async def delete_file(request: Request, file_id: str) -> Response:
    row = await owned_file(request, file_id)
    jobs = runner(request)
    # Decided with the row locked (jobs/store.py): a batch made from the file at the same time keeps it or fails.
    outcome = await asyncio.to_thread(jobs.store().delete_file, row["id"], owner())
    if outcome == "in_use":
        raise APIError(409, f"file {excerpt(file_id)!r} is the input of a batch still running; cancel it first",
                       "file_in_use", "file_id")
    if outcome == "deleted":
        await asyncio.to_thread(jobs.files.remove, row["id"])
    return json_response({"id": row["id"], "object": "file", "deleted": True})
