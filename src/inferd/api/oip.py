"""The Open Inference Protocol (KServe v2) over HTTP, as Triton, KServe, Seldon MLServer and OpenVINO Model Server
answer it, so ``tritonclient.http`` and KServe's InferenceGraph call inferd unchanged: health
(``/v2/health/live|ready``), server metadata (``/v2``), each model's metadata and readiness
(``/v2/models/{name}[/versions/{v}][/ready]``) and ``infer`` with named tensors (api/oip_tensors.py: JSON, or the
binary tensor extension tritonclient uses by default).

A model's tensors are its task's (api/oip_tasks.py, which the protocol over gRPC shares: grpc/oip.py). An infer
request runs the one engine call (api/engine_call.py), so limits, priorities, deadlines, tenants and metrics hold
as on every other route. Cohere's ``POST /v2/embed`` and ``/v2/rerank`` are other paths.

Refusals on these routes are in the protocol's shape, ``{"error": message}`` (tritonclient raises it as an
``InferenceServerException`` with the status): a request that is not a valid infer request (JSON, tensors, shapes,
datatypes, names) is 400; an engine refusal keeps its kind's status (api/errors.py KINDS: an unknown model 404, a
text too long 422, a full queue 503 with Retry-After). A refusal before the route (401 key, 413 body size) keeps
the one error shape.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel
from starlette.responses import Response

from inferd import __version__
from inferd.api.answers import ErrorResponse
from inferd.api.engine_call import INFERENCE_ERRORS, ask_engine, build
from inferd.api.errors import APIError
from inferd.api.health import readiness
from inferd.api.oip_tasks import check_version, description_of, plan, served_model, signature_of, versions_of
from inferd.api.oip_tensors import (
    BINARY,
    HEADER_LENGTH,
    OIPError,
    read_infer,
    write_infer,
)
from inferd.api.services import inference_auth, services

# Probes hold no key (as /health); the rest is the inference keys' business.
oip_health_router = APIRouter()
oip_router = APIRouter(dependencies=[Depends(inference_auth)])

Route = Callable[..., Awaitable[Response]]


def oip_errors(route: Route) -> Route:
    """An OIP route answers its refusals in the protocol's shape, ``{"error": message}``."""

    @functools.wraps(route)
    async def answered(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except APIError as exc:
            return _error(exc.message, exc.status, exc.headers)
        except OIPError as exc:
            return _error(exc.message, exc.status)

    return answered


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, headers=headers,
                    media_type="application/json")


def _json(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


# -- what the schema says (api/docs.py; tests/fuzz holds every route to it) ---------------------------------


class OIPErrorBody(BaseModel):
    """The protocol's error shape."""

    error: str


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class OutputTensorBody(BaseModel):
    """An output tensor: its ``data`` in JSON, or its size in ``parameters.binary_data_size`` after the header."""

    name: str
    datatype: str
    shape: list[int]
    data: list[float | str] | None = None
    parameters: dict[str, int] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[OutputTensorBody]


def _answers(ok: type[BaseModel], *errors: int, binary: bool = False) -> dict[int | str, Any]:
    """``responses=`` for an OIP route: its success body (or, ``binary``, the binary extension's too) and its
    errors in the protocol's shape, but for those refused before the route (401, 413), in the one shape."""
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ok.__name__}"}}}
    if binary:
        content[BINARY] = {"schema": {"type": "string", "format": "binary"}}
    out: dict[int | str, Any] = {200: {"model": ok, "content": content}}
    for status in errors:
        before = status in (401, 413)
        out[status] = {"model": ErrorResponse if before else OIPErrorBody,
                       "description": "Refused before the route (key, body size)" if before else
                       "The protocol's error shape"}
    return out


_INFER_ANSWERS = _answers(InferResponse, *INFERENCE_ERRORS, binary=True)
# FastAPI's 422 of a path parameter it cannot read (none here: names and versions are any text), in the one shape.
_PATH = {422: {"model": ErrorResponse, "description": "A path parameter the route cannot read"}}
_MODEL_ANSWERS = {**_answers(ModelMetadata, 401, 404), **_PATH}
# A model not ready is a 503 with the readiness body, as /v2/health/ready's.
_READY_ANSWERS = {**_answers(ModelReady, 401, 404), 503: {"model": ModelReady, "description": "Not ready"}, **_PATH}


# -- health and metadata -----------------------------------------------------------------------------------


@oip_health_router.get("/v2/health/live", responses={200: {"model": Live}, 503: {"model": Live}})
async def live(request: Request) -> Response:
    engine = services(request).engine
    ok = engine.alive or engine.draining
    return _json({"live": ok}, 200 if ok else 503)


@oip_health_router.get("/v2/health/ready", responses={200: {"model": Ready}, 503: {"model": Ready}})
async def ready(request: Request) -> Response:
    status, _ = readiness(request)
    return _json({"ready": status == 200}, status)


@oip_router.get("/v2", responses=_answers(ServerMetadata, 401))
async def server_metadata(request: Request) -> Response:
    return _json({"name": "inferd", "version": __version__, "extensions": ["binary_tensor_data"]})


async def _model_ready(request: Request, name: str, version: str | None) -> Response:
    served = served_model(request, name)
    status, _ = readiness(request, served.name)
    if status == 200:
        check_version(served, version)
    return _json({"name": served.name, "ready": status == 200}, status)


async def _metadata(request: Request, name: str, version: str | None) -> Response:
    served = served_model(request, name)
    check_version(served, version)
    _, signature = signature_of(served)
    return _json({"name": served.name, "versions": versions_of(served), "platform": "inferd",
                  "inputs": [t.wire() for t in signature.inputs],
                  "outputs": [t.wire() for t in signature.outputs(description_of(served))]})


# -- infer -------------------------------------------------------------------------------------------------


async def _infer(request: Request, name: str, version: str | None) -> Response:
    raw = await request.body()
    if request.headers.get("content-encoding", "identity") != "identity":
        raise OIPError("Content-Encoding: send the request uncompressed")
    body = read_infer(raw, request.headers.get(HEADER_LENGTH))
    planned = plan(request, body, name, version)
    names = planned.signature.names
    result = await ask_engine(request, build(request, planned.inputs, names, **planned.options), names)
    content, header_length = write_infer(*planned.answer(result))
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type=BINARY, headers={"Inference-Header-Content-Length": str(header_length)})


# The routes with a version come first: a model's name may hold "/" (as OpenAI's ids do), and the path
# converter would otherwise read ".../versions/1/infer" as a model named "m/versions/1".
_INFER = {"openapi_extra": {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object"}}, BINARY: {"schema": {"type": "string", "format": "binary"}}}}}}


@oip_router.get("/v2/models/{name:path}/versions/{version}/ready", responses=_READY_ANSWERS)
@oip_errors
async def version_ready(request: Request, name: str, version: str) -> Response:
    return await _model_ready(request, name, version)


@oip_router.post("/v2/models/{name:path}/versions/{version}/infer", responses=_INFER_ANSWERS, **_INFER)
@oip_errors
async def version_infer(request: Request, name: str, version: str) -> Response:
    return await _infer(request, name, version)


@oip_router.get("/v2/models/{name:path}/versions/{version}", responses=_MODEL_ANSWERS)
@oip_errors
async def version_metadata(request: Request, name: str, version: str) -> Response:
    return await _metadata(request, name, version)


@oip_router.get("/v2/models/{name:path}/ready", responses=_READY_ANSWERS)
@oip_errors
async def model_ready(request: Request, name: str) -> Response:
    return await _model_ready(request, name, None)


@oip_router.post("/v2/models/{name:path}/infer", responses=_INFER_ANSWERS, **_INFER)
@oip_errors
async def infer(request: Request, name: str) -> Response:
    return await _infer(request, name, None)


@oip_router.get("/v2/models/{name:path}", responses=_MODEL_ANSWERS)
@oip_errors
async def model_metadata(request: Request, name: str) -> Response:
    return await _metadata(request, name, None)
