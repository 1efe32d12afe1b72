"""The seed's /predict, OpenAI's embeddings, what is served (/v1/models, /info) and health.

Parse and validate, hand texts to the engine (api/inference.py), shape the answer; no model work here.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd import __version__
from inferd.api import vectors
from inferd.api.bodies import json_response, read_body
from inferd.api.errors import APIError
from inferd.api.inference import (
    INFERENCE_ERRORS,
    check_query,
    prechecked,
    require_task,
    run_task,
    served_name,
    task_of,
)
from inferd.api.schemas import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    Health,
    Info,
    ModelList,
    PredictRequest,
    PredictResponse,
    request_body,
    responses,
)
from inferd.api.services import inference_auth, services
from inferd.api.tei_routes import is_tei_predict, tei_info, tei_predict
from inferd.core.prompts import Prompt
from inferd.core.registry import ServedModel
from inferd.core.slots import ModelDescription

# Inference, and what is served (/v1/models, /info): the inference keys, checked once for the whole router.
router = APIRouter(dependencies=[Depends(inference_auth)])
# Health answers load balancers and probes, which hold no key.
health_router = APIRouter()


@router.post("/predict", openapi_extra=request_body(PredictRequest),
             responses=responses(PredictResponse, *INFERENCE_ERRORS))
async def predict(request: Request) -> Response:
    """The seed's endpoint, each task's natural result: ``{"texts": [...]}`` → ``{"results": [...], "model"}``.

    embedding: a vector per text; classification: ``{"label", "probs"}`` per text; rerank: ``texts`` holds
    ``[query, document]`` pairs and each gets its score. A body with ``inputs`` (and no ``texts``) is
    text-embeddings-inference's /predict (api/tei_routes.py).
    """
    if await is_tei_predict(request):
        return await tei_predict(request)
    task = "embedding"

    def check(body: PredictRequest) -> None:
        nonlocal task
        task = task_of(request, body.model)  # the named model's (or the default model's) task sets the shape
        if task == "rerank":
            _check_pairs(request, body)
        else:
            prechecked(request, body.texts, "texts", True)

    body = await read_body(request, PredictRequest, check)
    if task == "rerank":
        return await _predict_pairs(request, body)
    result = await run_task(request, body.texts, body, "texts", listed=True, task=task)
    if isinstance(result, Response):
        return result
    outputs: list[Any] = result.outputs
    if task == "classification":
        labels = list(result.description.labels or ())
        outputs = [{"label": labels[int(p.argmax())], "probs": p} for p in outputs]
    return json_response({"results": outputs, "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens}})


def _check_pairs(request: Request, body: PredictRequest) -> None:
    for i, pair in enumerate(body.texts):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise APIError(422, f"texts[{i}]: must be a [query, document] pair on a rerank model",
                           "invalid_type", f"texts[{i}]")
        check_query(request, pair[0], f"texts[{i}][0]")
    prechecked(request, [p[1] for p in body.texts], "texts", True)


async def _predict_pairs(request: Request, body: PredictRequest) -> Response:
    """/predict on a reranker: ``{"texts": [[query, document], ...]}`` → ``{"results": [score, ...]}``."""
    pairs = [(q, d) for q, d in body.texts]
    result = await run_task(request, pairs, body, "texts", listed=True, task="rerank")
    if isinstance(result, Response):
        return result
    return json_response({"results": [float(o[0]) for o in result.outputs], "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens}})


@router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingsRequest),
             responses=responses(EmbeddingsResponse, *INFERENCE_ERRORS))
async def embeddings(request: Request) -> Response:
    """OpenAI-compatible embeddings (the official ``openai`` client works against it)."""
    require_task(request, "embedding")
    body = await read_body(request, EmbeddingsRequest, lambda b: _check_input(request, b))
    listed = isinstance(body.input, list)
    texts = body.input if listed else [body.input]
    # The default prompt of the model that runs it (as sentence-transformers' encode), and a Matryoshka size cut
    # here by that model's normalisation.
    result = await run_task(request, texts, body, "input", listed, task="embedding", dimensions=body.dimensions,
                            prompt=Prompt())
    if isinstance(result, Response):
        return result
    outputs = result.outputs if body.dimensions is None else vectors.vectors_of(result, body.dimensions)
    if body.encoding_format == "base64":
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")}
                for i, v in enumerate(outputs)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(outputs)]
    return json_response({"object": "list", "data": data, "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens,
                                    "total_tokens": result.prompt_tokens}})


def _check_input(request: Request, body: EmbeddingsRequest) -> None:
    listed = isinstance(body.input, list)
    # OpenAI also accepts token ids (a list of ints, or a list of such lists); this service takes text only.
    # The first item decides, in constant time: a long list of numbers must not be walked on the event loop.
    if listed and body.input and isinstance(body.input[0], int | list) and not isinstance(body.input[0], bool):
        raise APIError(422, "input: token arrays are not supported; send text", "unsupported_input", "input")
    prechecked(request, body.input if listed else [body.input], "input", listed)


@router.get("/v1/models", responses=responses(ModelList, 401))
async def models(request: Request) -> Response:
    """Every served model by the name clients send as ``model``, with its task, readiness and versions."""
    s = services(request)
    data = []
    for served in s.registry:
        manager = served.manager
        versions = [{"version": slot.version, "role": role, "backend": slot.description.backend,
                     "dtype": slot.description.dtype, "quantize": slot.description.quantize,
                     "weight": manager.canary_weight if role == "canary" else None}
                    for role, slot in manager.slots()]
        data.append({"id": served.name, "object": "model", "created": int(s.started_at), "owned_by": "inferd",
                     "task": served.task, "state": manager.state, "ready": manager.state == "ready",
                     "required": served.required, "default": s.registry.default_for(served.task) is served,
                     "backend": versions[0]["backend"] if versions else served.settings.model.backend,
                     "versions": versions})
    return json_response({"object": "list", "data": data})


@router.get("/info", responses=responses(Info, 401))
async def info(request: Request) -> Response:
    # What is served, on which device, with which limits: as much the inference keys' business as /v1/models
    # (the router checks them). ``models`` holds every served slot of every model; the top-level fields are the
    # default model's active slot (a single-model server's).
    registry = services(request).registry
    default = registry.first()
    state = default.manager.state if default is not None else "not_loaded"
    out: dict[str, Any] = {"inferd_version": __version__, "state": state, "models": []}
    ordered = sorted(registry, key=lambda m: m is not default)
    for served in ordered:
        manager = served.manager
        for role, slot in manager.slots():
            out["models"].append(_slot_info(slot.description, role,
                                            manager.canary_weight if role == "canary" else None, manager.state))
    if out["models"] and out["models"][0]["name"] == (default.name if default else None):
        out.update({k: out["models"][0][k] for k in ("task", "name", "version", "dimension", "max_seq_length",
                                                     "device", "dtype", "backend", "quantize")})
    out.update(tei_info(request))  # the fields text-embeddings-inference's clients read (model_id, model_type, ...)
    return json_response(out)


def _slot_info(d: ModelDescription, role: str, weight: float | None, state: str) -> dict[str, Any]:
    """A slot as /info shows it: its description, built at load (core/slots.py)."""
    matryoshka = d.matryoshka_dimensions
    return {"role": role, "name": d.name, "version": d.version, "task": d.task, "state": state,
            "labels": None if d.labels is None else list(d.labels), "dimension": d.dimension,
            "max_seq_length": d.max_seq_length, "device": d.device, "dtype": d.dtype, "pooling": d.pooling,
            "normalize": d.normalize, "load_seconds": d.load_seconds, "weight": weight,
            "backend": d.backend, "quantize": d.quantize, "backend_info": d.backend_info,
            "matryoshka_dimensions": list(matryoshka) if isinstance(matryoshka, tuple) else matryoshka,
            "prompts": None if d.prompts is None else dict(d.prompts), "default_prompt_name": d.default_prompt_name,
            "similarity_fn_name": d.facts.get("similarity_fn_name")}


def _model_readiness(served: ServedModel) -> tuple[bool, dict[str, Any]]:
    manager = served.manager
    if manager.state == "ready":
        active = manager.active
        return True, {"status": "ready", "model": served.name, "version": active.version if active else None}
    if manager.state == "failed":
        return False, {"status": "failed", "model": served.name, "reason": "model load failed"}
    if manager.state == "not_loaded" and served.settings.model.load_mode == "lazy":
        # Lazy: the first request loads the model, so the instance must be routable before that.
        return True, {"status": "ready", "model": served.name, "loaded": False}
    return False, {"status": "loading", "model": served.name}


def readiness(request: Request, model: str | None = None) -> tuple[int, dict[str, Any]]:
    """Ready when every ``required`` model is (``model``: that one alone). The state only; the cause of a
    failure (paths, exception text) goes to the log and /admin/models."""
    s = services(request)
    engine = s.engine
    if engine.draining:
        return 503, {"status": "draining"}
    if not engine.alive:
        return 503, {"status": "failed", "reason": "inference worker stopped"}
    if model is not None:
        served = s.registry.get(model)
        if served is None:
            raise APIError(404, f"model {model!r} is not served here; the models served: "
                           f"{', '.join(s.registry.names())}", "model_not_found", "model")
        ok, body = _model_readiness(served)
        return (200 if ok else 503), body
    rows = [(served, *_model_readiness(served)) for served in s.registry]
    states = {served.name: body["status"] for served, _, body in rows}
    blocking = [body for served, ok, body in rows if served.required and not ok]
    default = s.registry.first()
    first = next((body for served, _, body in rows if served is default), {})
    extra = {"models": states} if len(rows) > 1 else {}
    if not blocking:
        return 200, {**first, "status": "ready", **extra}
    failed = any(body["status"] == "failed" for body in blocking)
    return 503, {"status": "failed" if failed else "loading", **({"reason": "model load failed"} if failed else {}),
                 **extra}


_HEALTH = {200: {"model": Health}, 503: {"model": Health, "description": "Not ready (or dead); Retry-After"}}
# /health/ready?model=NAME: a name not served is 404 in the error shape; a bad query, 422.
_READY = {**_HEALTH, **{k: v for k, v in responses(Health, 404, 422).items() if k != 200}}


@health_router.get("/health", responses=_READY)
@health_router.get("/health/ready", responses=_READY)
async def health_ready(request: Request, model: str | None = None) -> Response:
    """200 when every required model is ready (``?model=NAME``: when that model is), else 503 + Retry-After."""
    status, body = readiness(request, model)
    return json_response(body, status, {"Retry-After": "1"} if status == 503 else None)


@health_router.get("/health/live", responses=_HEALTH)
async def health_live(request: Request) -> Response:
    s = services(request)
    if not s.engine.alive and not s.engine.draining:
        return json_response({"status": "dead", "reason": "inference worker stopped"}, 503)
    return json_response({"status": "alive", "uptime_s": round(time.time() - s.started_at, 3)})
