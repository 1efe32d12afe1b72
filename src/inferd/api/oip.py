"""The Open Inference Protocol (KServe v2) over HTTP, as Triton, KServe, Seldon MLServer and OpenVINO Model Server
answer it, so ``tritonclient.http`` and KServe's InferenceGraph call inferd unchanged: health
(``/v2/health/live|ready``), server metadata (``/v2``), each model's metadata and readiness
(``/v2/models/{name}[/versions/{v}][/ready]``) and ``infer`` with named tensors (api/oip_tensors.py: JSON, or the
binary tensor extension tritonclient uses by default).

A model's tensors are its task's (``SIGNATURES``, keyed by the task object): an embedding model takes ``text``
(BYTES) and gives ``embedding`` (FP32, one row per text); a reranker takes ``query`` (one BYTES element) and
``documents`` (BYTES) and gives ``score`` (FP32, one per document, in the documents' order); a classifier takes
``text`` and gives ``label`` (BYTES), ``score`` (FP32: the label's probability) and ``probabilities`` (FP32, one
row per text, in the order of the model's labels). An infer request runs the one engine call
(api/engine_call.py), so limits, priorities, deadlines, tenants and metrics hold as on every other route; Triton's
request parameters ``priority`` (0 the default, 1 the highest level, each level above one step lower) and
``timeout`` (microseconds) become the request's. Cohere's ``POST /v2/embed`` and ``/v2/rerank`` are other paths.

Refusals on these routes are in the protocol's shape, ``{"error": message}`` (tritonclient raises it as an
``InferenceServerException`` with the status): a request that is not a valid infer request (JSON, tensors, shapes,
datatypes, names) is 400; an engine refusal keeps its kind's status (api/errors.py KINDS: an unknown model 404, a
text too long 422, a full queue 503 with Retry-After). A refusal before the route (401 key, 413 body size) keeps
the one error shape.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd import __version__
from inferd.api import vectors
from inferd.api.catalog import visible
from inferd.api.engine_call import build, run
from inferd.api.errors import APIError, Names, excerpt, refusal
from inferd.api.health import readiness
from inferd.api.oip_tensors import (
    BINARY,
    HEADER_LENGTH,
    InferBody,
    OIPError,
    OutputTensor,
    TensorSpec,
    read_infer,
    write_infer,
)
from inferd.api.services import inference_auth, services
from inferd.core.description import ModelDescription
from inferd.core.errors import Kind
from inferd.core.outcomes import TaskResult
from inferd.core.registry import ServedModel
from inferd.core.tasks.kinds import CLASSIFICATION, EMBEDDING, RERANK, task_of
from inferd.core.tasks.task import Task

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


# -- each task's tensors -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Signature:
    """A task's tensors: the inputs it takes, the outputs it gives (by the model's description: a dimension, a
    count of labels), the engine's inputs made of the texts sent, and the output tensors of a result."""

    inputs: tuple[TensorSpec, ...]
    outputs: Callable[[ModelDescription | None], tuple[TensorSpec, ...]]
    engine_inputs: Callable[[dict[str, list[str]]], list[Any]]
    answer: Callable[[TaskResult], list[OutputTensor]]
    names: Names  # how the engine's refusals name the inputs


def _texts(inputs: dict[str, list[str]]) -> list[Any]:
    return inputs["text"]


def _pairs(inputs: dict[str, list[str]]) -> list[Any]:
    if len(inputs["query"]) != 1:
        raise OIPError(f"input 'query': holds one text (shape [1]); {len(inputs['query'])} were sent")
    query = inputs["query"][0]
    return [(query, d) for d in inputs["documents"]]


def _embedding_outputs(d: ModelDescription | None) -> tuple[TensorSpec, ...]:
    return (TensorSpec("embedding", "FP32", (-1, (d.dimension if d else None) or -1)),)


def _embedded(result: TaskResult) -> list[OutputTensor]:
    return [OutputTensor("embedding", "FP32", vectors.vectors_of(result, None))]


def _scored(result: TaskResult) -> list[OutputTensor]:
    return [OutputTensor("score", "FP32", np.array([o[0] for o in result.outputs], dtype=np.float32))]


def _labels_count(d: ModelDescription | None) -> int:
    return len(d.labels) if d is not None and d.labels else -1


def _classification_outputs(d: ModelDescription | None) -> tuple[TensorSpec, ...]:
    return (TensorSpec("label", "BYTES", (-1,)), TensorSpec("score", "FP32", (-1,)),
            TensorSpec("probabilities", "FP32", (-1, _labels_count(d))))


def _classified(result: TaskResult) -> list[OutputTensor]:
    labels = list(result.description.labels or ())
    probs = np.vstack([np.asarray(p, dtype=np.float32) for p in result.outputs])
    best = probs.argmax(axis=1)
    return [OutputTensor("label", "BYTES", [labels[i] for i in best]),
            OutputTensor("score", "FP32", probs[np.arange(len(best)), best]),
            OutputTensor("probabilities", "FP32", probs)]


_TEXT = TensorSpec("text", "BYTES", (-1,))
# The engine's options by the request's parameters they come from.
_PARAMETERS = {"priority": "parameters.priority", "timeout_ms": "parameters.timeout"}
SIGNATURES: dict[Task, Signature] = {
    EMBEDDING: Signature((_TEXT,), _embedding_outputs, _texts, _embedded, Names("text", fields=_PARAMETERS)),
    RERANK: Signature((TensorSpec("query", "BYTES", (1,)), TensorSpec("documents", "BYTES", (-1,))),
                      lambda d: (TensorSpec("score", "FP32", (-1,)),), _pairs, _scored,
                      Names("documents", query="query", fields=_PARAMETERS)),
    CLASSIFICATION: Signature((_TEXT,), _classification_outputs, _texts, _classified,
                              Names("text", fields=_PARAMETERS)),
}


# -- which model -------------------------------------------------------------------------------------------


def _served(request: Request, name: str) -> ServedModel:
    """The model a path names, if the caller may call it (a tenant restricted to some sees only those)."""
    served = services(request).registry.get(name)
    shown = visible(request)
    if served is None or served not in shown:
        raise refusal(Kind.MODEL_NOT_FOUND, f"model {excerpt(name)!r} is not served here; the models served: "
                      f"{', '.join(m.name for m in shown) or 'none'}", param="model")
    return served


def _signature(served: ServedModel) -> tuple[Task, Signature]:
    # A model whose task is known only once it loads is described as an embedding model until then.
    task = task_of(served.task) if served.task else EMBEDDING
    signature = SIGNATURES.get(task)
    if signature is None:
        raise OIPError(f"model {served.name!r} serves the {task.name} task, which has no tensors in the Open "
                       "Inference Protocol here", status=404)
    return task, signature


def _description(served: ServedModel) -> ModelDescription | None:
    slots = served.manager.slots()
    return slots[0][1].description if slots else None


def _versions(served: ServedModel) -> list[str]:
    return [slot.version for _, slot in served.manager.slots()]


def _check_version(served: ServedModel, version: str | None) -> None:
    if version is not None and version not in _versions(served):
        raise refusal(Kind.MODEL_NOT_FOUND, f"model {served.name!r} serves version "
                      f"{' and '.join(_versions(served)) or 'none yet'}, not {excerpt(version)!r}", param="model")


# -- health and metadata -----------------------------------------------------------------------------------


@oip_health_router.get("/v2/health/live")
async def live(request: Request) -> Response:
    engine = services(request).engine
    ok = engine.alive or engine.draining
    return _json({"live": ok}, 200 if ok else 503)


@oip_health_router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    status, _ = readiness(request)
    return _json({"ready": status == 200}, status)


@oip_router.get("/v2")
async def server_metadata(request: Request) -> Response:
    return _json({"name": "inferd", "version": __version__, "extensions": ["binary_tensor_data"]})


async def _model_ready(request: Request, name: str, version: str | None) -> Response:
    served = _served(request, name)
    status, _ = readiness(request, served.name)
    if status == 200:
        _check_version(served, version)
    return _json({"name": served.name, "ready": status == 200}, status)


async def _metadata(request: Request, name: str, version: str | None) -> Response:
    served = _served(request, name)
    _check_version(served, version)
    _, signature = _signature(served)
    return _json({"name": served.name, "versions": _versions(served), "platform": "inferd",
                  "inputs": [t.wire() for t in signature.inputs],
                  "outputs": [t.wire() for t in signature.outputs(_description(served))]})


# -- infer -------------------------------------------------------------------------------------------------


def _options(body: InferBody) -> dict[str, Any]:
    """Triton's request parameters as the engine's options: ``priority`` levels (1 the highest, 0 the default)
    and ``timeout`` in microseconds."""
    out: dict[str, Any] = {}
    priority = body.parameters.get("priority")
    if priority is not None:
        if type(priority) is not int or priority < 0:
            raise OIPError(f"parameters.priority: must be a level, an integer from 0 (the default) up, not "
                           f"{excerpt(str(priority))!r}")
        out["priority"] = -max(0, priority - 1)
    timeout = body.parameters.get("timeout")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise OIPError(f"parameters.timeout: must be microseconds, not {excerpt(str(timeout))!r}")
        out["timeout_ms"] = timeout / 1000
    return out


def _chosen(signature: Signature, body: InferBody) -> list[str]:
    """The inputs sent are exactly the task's; the outputs asked for, the task's (none asked: every one)."""
    wanted = [t.name for t in signature.inputs]
    missing = [n for n in wanted if n not in body.inputs]
    extra = [n for n in body.inputs if n not in wanted]
    if missing or extra:
        what = f"missing {missing}" if missing else f"unknown {[excerpt(n) for n in extra]}"
        raise OIPError(f"inputs: this model takes {wanted}; {what}")
    given = [t.name for t in signature.outputs(None)]
    if body.outputs is None:
        return given
    unknown = [n for n in body.outputs if n not in given]
    if unknown:
        raise OIPError(f"outputs: this model gives {given}; unknown {[excerpt(n) for n in unknown]}")
    return list(body.outputs)


async def _infer(request: Request, name: str, version: str | None) -> Response:
    raw = await request.body()
    if request.headers.get("content-encoding", "identity") != "identity":
        raise OIPError("Content-Encoding: send the request uncompressed")
    body = read_infer(raw, request.headers.get(HEADER_LENGTH))
    served = _served(request, name)
    task, signature = _signature(served)
    names = _chosen(signature, body)
    model = served.name if version is None else f"{served.name}@{version}"
    engine_request = build(request, signature.engine_inputs(body.inputs), signature.names, task=task.name,
                           model=model, **_options(body))
    result = await run(request, engine_request, signature.names)
    tensors = {t.name: t for t in signature.answer(result)}
    binary = body.outputs or {}
    chosen = [(tensors[n], binary.get(n, body.binary_default)) for n in names]
    head: dict[str, Any] = {"model_name": served.name, "model_version": result.version}
    if body.id is not None:
        head["id"] = body.id
    content, header_length = write_infer(head, chosen)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type=BINARY, headers={"Inference-Header-Content-Length": str(header_length)})


# The routes with a version come first: a model's name may hold "/" (as OpenAI's ids do), and the path
# converter would otherwise read ".../versions/1/infer" as a model named "m/versions/1".
_INFER = {"openapi_extra": {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object"}}, BINARY: {"schema": {"type": "string", "format": "binary"}}}}}}


@oip_router.get("/v2/models/{name:path}/versions/{version}/ready")
@oip_errors
async def version_ready(request: Request, name: str, version: str) -> Response:
    return await _model_ready(request, name, version)


@oip_router.post("/v2/models/{name:path}/versions/{version}/infer", **_INFER)
@oip_errors
async def version_infer(request: Request, name: str, version: str) -> Response:
    return await _infer(request, name, version)


@oip_router.get("/v2/models/{name:path}/versions/{version}")
@oip_errors
async def version_metadata(request: Request, name: str, version: str) -> Response:
    return await _metadata(request, name, version)


@oip_router.get("/v2/models/{name:path}/ready")
@oip_errors
async def model_ready(request: Request, name: str) -> Response:
    return await _model_ready(request, name, None)


@oip_router.post("/v2/models/{name:path}/infer", **_INFER)
@oip_errors
async def infer(request: Request, name: str) -> Response:
    return await _infer(request, name, None)


@oip_router.get("/v2/models/{name:path}")
@oip_errors
async def model_metadata(request: Request, name: str) -> Response:
    return await _metadata(request, name, None)
