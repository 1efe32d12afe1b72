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
from inferd.api.bodies import json_response, read_body
from inferd.api.errors import APIError
from inferd.api.inference import (
    INFERENCE_ERRORS,
    check_query,
    prechecked,
    require_task,
    run_task,
    served_name,
    served_task,
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

# Inference, and what is served (/v1/models, /info): the inference keys, checked once for the whole router.
router = APIRouter(dependencies=[Depends(inference_auth)])
# Health answers load balancers and probes, which hold no key.
health_router = APIRouter()


@router.post("/predict", openapi_extra=request_body(PredictRequest),
             responses=responses(PredictResponse, *INFERENCE_ERRORS))
async def predict(request: Request) -> Response:
    """The seed's endpoint, each task's natural result: ``{"texts": [...]}`` → ``{"results": [...], "model"}``.

    embedding: a vector per text; classification: ``{"label", "probs"}`` per text; rerank: ``texts`` holds
    ``[query, document]`` pairs and each gets its score.
    """
    task = served_task(request)
    if task == "rerank":
        return await _predict_pairs(request)
    body = await read_body(request, PredictRequest, lambda b: prechecked(request, b.texts, "texts", True))
    result = await run_task(request, body.texts, body, "texts", listed=True, task=task)
    if isinstance(result, Response):
        return result
    outputs: list[Any] = result.outputs
    if task == "classification":
        active = services(request).manager.active
        labels = active.info["labels"] if active else []
        outputs = [{"label": labels[int(p.argmax())], "probs": p} for p in outputs]
    return json_response({"results": outputs, "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens}})


async def _predict_pairs(request: Request) -> Response:
    """/predict on a reranker: ``{"texts": [[query, document], ...]}`` → ``{"results": [score, ...]}``."""

    def check(body: PredictRequest) -> None:
        for i, pair in enumerate(body.texts):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise APIError(422, f"texts[{i}]: must be a [query, document] pair on a rerank model",
                               "invalid_type", f"texts[{i}]")
            check_query(request, pair[0], f"texts[{i}][0]")
        prechecked(request, [p[1] for p in body.texts], "texts", True)

    body = await read_body(request, PredictRequest, check)
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
    result = await run_task(request, texts, body, "input", listed, task="embedding",
                            dimensions=body.dimensions)
    if isinstance(result, Response):
        return result
    if body.encoding_format == "base64":
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")}
                for i, v in enumerate(result.outputs)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(result.outputs)]
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
    s = services(request)
    data = []
    for role, slot in s.manager.slots():
        data.append({"id": f"{slot.info['name']}@{slot.info['version']}", "object": "model",
                     "created": int(s.started_at), "owned_by": "inferd", "role": role,
                     "task": slot.info["task"]})
    return json_response({"object": "list", "data": data})


@router.get("/info", responses=responses(Info, 401))
async def info(request: Request) -> Response:
    # What is served, on which device, with which limits: as much the inference keys' business as /v1/models
    # (the router checks them).
    manager = services(request).manager
    out: dict[str, Any] = {"inferd_version": __version__, "state": manager.state, "models": []}
    for role, slot in manager.slots():
        d = slot.info  # the model's description, built at load (core/slots.py)
        out["models"].append({
            "role": role, "name": d["name"], "version": d["version"], "task": d["task"],
            "labels": d.get("labels"), "dimension": d.get("dimension"), "max_seq_length": d["max_seq_length"],
            "device": d["device"], "dtype": d["dtype"], "pooling": d.get("pooling"), "normalize": d.get("normalize"),
            "load_seconds": d["load_seconds"], "weight": manager.canary_weight if role == "canary" else None,
            "backend": d["backend"], "quantize": d["quantize"], "backend_info": d["backend_info"]})
    if out["models"]:
        out.update({k: out["models"][0][k] for k in ("task", "name", "version", "dimension", "max_seq_length",
                                                     "device", "dtype", "backend", "quantize")})
    return json_response(out)


def readiness(request: Request) -> tuple[int, dict[str, Any]]:
    """The state only; the cause of a failure (paths, exception text) goes to the log and /admin/models."""
    s = services(request)
    engine, manager = s.engine, s.manager
    if engine.draining:
        return 503, {"status": "draining"}
    if not engine.alive:
        return 503, {"status": "failed", "reason": "inference worker stopped"}
    if manager.state == "ready":
        active = manager.active
        return 200, {"status": "ready", "model": active.spec.name if active else None,
                     "version": active.version if active else None}
    if manager.state == "failed":
        return 503, {"status": "failed", "reason": "model load failed"}
    if manager.state == "not_loaded" and s.settings.model.load_mode == "lazy":
        # Lazy: the first request loads the model, so the instance must be routable before that.
        return 200, {"status": "ready", "loaded": False}
    return 503, {"status": "loading"}


_HEALTH = {200: {"model": Health}, 503: {"model": Health, "description": "Not ready (or dead); Retry-After"}}


@health_router.get("/health", responses=_HEALTH)
@health_router.get("/health/ready", responses=_HEALTH)
async def health_ready(request: Request) -> Response:
    status, body = readiness(request)
    return json_response(body, status, {"Retry-After": "1"} if status == 503 else None)


@health_router.get("/health/live", responses=_HEALTH)
async def health_live(request: Request) -> Response:
    s = services(request)
    if not s.engine.alive and not s.engine.draining:
        return json_response({"status": "dead", "reason": "inference worker stopped"}, 503)
    return json_response({"status": "alive", "uptime_s": round(time.time() - s.started_at, 3)})
