"""OpenAI's Batches API, as the ``openai`` client calls it: ``POST /v1/batches`` (``input_file_id``, ``endpoint``:
``/v1/embeddings``, ``/v1/rerank``, ``/v1/encode`` or ``/v1/classify``, ``completion_window``, ``metadata``),
``GET /v1/batches/{id}`` (status, ``request_counts``, ``output_file_id``, ``error_file_id``),
``POST /v1/batches/{id}/cancel`` and ``GET /v1/batches`` (newest first; ``after``, ``limit``, ``has_more``).

Creating a batch only records it and its chunks (jobs/store.py); the runner in every serving process runs them
(jobs/runner.py). A batch is its owner's, as a file is (api/batch_files.py): another tenant's is a 404.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.responses import Response

from inferd.api.answers import raw_body, responses
from inferd.api.batch_files import owned_file, owner, paged, runner
from inferd.api.bodies import json_response, read_body
from inferd.api.errors import APIError
from inferd.api.schemas import request_body
from inferd.api.services import inference_auth
from inferd.core.errors import excerpt
from inferd.jobs.files import new_id
from inferd.jobs.lines import FileRefused, duplicates_in, endpoint_of, split
from inferd.jobs.runner import JobRunner
from inferd.jobs.store import FileGone, decoded

log = logging.getLogger(__name__)

batches_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys: a tenant's own batches

_OBJECT = raw_body("application/json", {"type": "object"})
_ERRORS = (400, 401, 404, 409, 413, 422)
_WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")


class BatchRequest(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(min_length=1, max_length=64)
    completion_window: str = Field("24h", description="Hours, as '24h' (OpenAI's only value); past it, a batch "
                                   "not done is expired with what it has done")
    # OpenAI's bounds: 16 pairs, keys of 64 characters at most, values of 512.
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = Field(None, max_length=16)
    # The openai client's; output files here expire with jobs.expiry_s.
    output_expires_after: dict[str, Any] | None = None


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    def stamp(key: str) -> int | None:
        value = row.get(key)
        return int(value) if value else None

    errors = decoded(row.get("errors"))
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            "created_at": int(row["created_at"]),
            **{f"{s}_at": stamp(f"{s}_at") for s in ("in_progress", "expires", "finalizing", "completed",
                                                      "failed", "expired", "cancelling", "cancelled")},
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": decoded(row["metadata"])}


def _plan(data: bytes, chunk_size: int) -> tuple[list[tuple[int, int, int]], int, list[int]]:
    """The chunks' spans (start byte, stop byte, first line) of ``chunk_size`` lines each, the count of lines that
    are not blank, and the lines whose custom_id an earlier line has."""
    raws = split(data)
    spans: list[tuple[int, int, int]] = []
    offset = 0
    for first in range(0, len(raws), chunk_size):
        stop = _end(data, offset, raws[first:first + chunk_size])
        spans.append((offset, stop, first))
        offset = stop
    return spans, sum(1 for r in raws if r.strip()), sorted(duplicates_in(raws))


def _end(data: bytes, start: int, raws: list[bytes]) -> int:
    """The byte after the last of ``raws`` (and its line terminator), the lines starting at ``start``."""
    at = start
    for raw in raws:
        at += len(raw)
        if data.startswith(b"\r\n", at):
            at += 2
        elif data.startswith(b"\n", at):
            at += 1
    return at


@batches_router.post("/v1/batches", openapi_extra=request_body(BatchRequest), responses=responses(_OBJECT, *_ERRORS))
async def create_batch(request: Request) -> Response:
    jobs = runner(request)
    body = await read_body(request, BatchRequest)
    try:
        endpoint = endpoint_of(body.endpoint)
    except FileRefused as exc:
        raise APIError(400, exc.message, exc.code, exc.param) from None
    window = _WINDOW.match(body.completion_window)
    if window is None:
        raise APIError(400, "completion_window must be hours, as '24h'", "invalid_value", "completion_window")
    source = await owned_file(request, body.input_file_id)
    if source["purpose"] != "batch":
        raise APIError(400, f"file {body.input_file_id!r} is not a batch input file (purpose {source['purpose']!r})",
                       "invalid_file", "input_file_id")
    try:
        row = await asyncio.to_thread(_record, jobs, source, endpoint.path, body, int(window.group(1)))
    except (FileGone, FileNotFoundError):  # deleted since it was looked up
        raise APIError(404, f"no file {body.input_file_id!r}", "file_not_found", "input_file_id") from None
    log.info("batch %s: in_progress (%d lines of %s, %s)", row["id"], row["total"], source["id"], endpoint.path,
             extra={"batch": row["id"], "state": "in_progress"})
    jobs.wake()
    return json_response(batch_object(row))


def _record(jobs: JobRunner, source: dict[str, Any], endpoint: str, body: BatchRequest, hours: int) -> dict[str, Any]:
    data = jobs.files.read(source["id"])
    spans, total, duplicates = _plan(data, jobs.settings.chunk_size)
    now = time.time()
    row = {"id": new_id("batch_"), "owner": source["owner"], "endpoint": endpoint, "input_file_id": source["id"],
           "completion_window": body.completion_window, "status": "in_progress", "created_at": now,
           "in_progress_at": now, "expires_at": now + hours * 3600.0, "total": total, "completed": 0, "failed": 0,
           "output_file_id": None, "error_file_id": None, "metadata": body.metadata, "duplicates": duplicates}
    jobs.store().add_batch(row, spans)
    return {**row, **{f"{s}_at": None for s in ("finalizing", "completed", "failed", "expired", "cancelling",
                                                 "cancelled")}, "in_progress_at": now}


async def _owned(request: Request, batch_id: str) -> dict[str, Any]:
    row = await asyncio.to_thread(runner(request).store().batch, batch_id, owner())
    if row is None:
        raise APIError(404, f"no batch {excerpt(batch_id)!r}", "batch_not_found", "batch_id")
    return row


@batches_router.get("/v1/batches/{batch_id}", responses=responses(_OBJECT, *_ERRORS))
async def get_batch(request: Request, batch_id: str) -> Response:
    return json_response(batch_object(await _owned(request, batch_id)))


@batches_router.post("/v1/batches/{batch_id}/cancel", responses=responses(_OBJECT, *_ERRORS))
async def cancel_batch(request: Request, batch_id: str) -> Response:
    """Stops within one chunk: no further chunk starts; the chunks running finish; then the batch is cancelled,
    its output the lines done."""
    await _owned(request, batch_id)
    jobs = runner(request)
    store = jobs.store()
    if await asyncio.to_thread(store.set_status, batch_id, "cancelling", owner(), ("validating", "in_progress")):
        log.info("batch %s: cancelling", batch_id, extra={"batch": batch_id, "state": "cancelling"})
        jobs.wake()
    row = await _owned(request, batch_id)
    if row["status"] in ("completed", "failed", "expired"):
        raise APIError(409, f"batch {excerpt(batch_id)!r} is already {row['status']}", "batch_finished", "batch_id")
    return json_response(batch_object(row))


@batches_router.get("/v1/batches", responses=responses(_OBJECT, *_ERRORS))
async def list_batches(request: Request, after: str | None = None,
                       limit: int = Query(20, ge=1, le=100)) -> Response:
    rows, more = await paged(after, runner(request).store().batches, owner(), after, limit)
    data = [batch_object(r) for r in rows]
    return json_response({"object": "list", "data": data, "has_more": more,
                          "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})
