"""HTTP routes: parse and validate, hand texts to the engine, shape the answer. No model work here."""

from __future__ import annotations

import base64
import time
from typing import Any, TypeVar

import numpy as np
import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from inferd import __version__
from inferd.api.errors import APIError, excerpt
from inferd.api.middleware import context
from inferd.api.schemas import EmbeddingsRequest, PredictRequest
from inferd.api.security import require_keys
from inferd.core.work import ClientGone, EmbedResult, EngineError

router = APIRouter()
B = TypeVar("B", bound=BaseModel)

_JSON_BODY = {"requestBody": {"required": True, "content": {"application/json": {}}}}


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    headers=headers, media_type="application/json")


async def read_body(request: Request, model: type[B]) -> B:
    body = await request.body()
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON (or not UTF-8): {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        # An unknown field's name is client input: echo only an excerpt of it.
        param = excerpt(".".join(str(p) for p in err["loc"])) or None
        what = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise APIError(422, f"{param}: {what}", "invalid_value", param) from None


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next message can only be the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _embed(request: Request, texts: list[Any], body: PredictRequest | EmbeddingsRequest,
                 field: str, listed: bool) -> EmbedResult | Response:
    engine = request.app.state.engine
    if request.app.state.settings.server.log_inputs:
        # Only when the operator asked for it: request text is user data and stays out of logs by default.
        context(request.scope)["inputs"] = texts
    try:
        result = await engine.embed(
            texts, priority=body.priority, timeout_ms=body.timeout_ms, model=body.model,
            routing_key=request.headers.get("x-routing-key"),
            disconnected=lambda: _disconnected(request))
    except EngineError as exc:
        param = field if exc.param is None else (f"{field}[{exc.param}]" if listed else field)
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        message = f"{param}: {exc.message}" if exc.status == 422 else exc.message
        raise APIError(exc.status, message, exc.code, param if exc.status == 422 else None,
                       headers=headers) from None
    except ClientGone:
        return Response(status_code=499)
    ctx = context(request.scope)
    ctx.update(result.timings)
    ctx["version"] = result.version
    request.app.state.metrics.version_requests.labels(result.version).inc()
    return result


def _served_name(result: EmbedResult) -> str:
    return f"{result.model}@{result.version}"


@router.post("/predict", openapi_extra=_JSON_BODY)
async def predict(request: Request) -> Response:
    """The seed's endpoint: ``{"texts": [...]}`` → ``{"results": [[...]], "model": "name@version"}``."""
    settings = request.app.state.settings
    require_keys(request, settings.server.api_keys, "inference")
    body = await read_body(request, PredictRequest)
    result = await _embed(request, body.texts, body, "texts", listed=True)
    if isinstance(result, Response):
        return result
    return json_response({"results": result.vectors, "model": _served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens}})


@router.post("/v1/embeddings", openapi_extra=_JSON_BODY)
async def embeddings(request: Request) -> Response:
    """OpenAI-compatible embeddings (the official ``openai`` client works against it)."""
    settings = request.app.state.settings
    require_keys(request, settings.server.api_keys, "inference")
    body = await read_body(request, EmbeddingsRequest)
    listed = isinstance(body.input, list)
    texts = body.input if listed else [body.input]
    # OpenAI also accepts token ids (a list of ints, or a list of such lists); this service takes text only.
    if listed and body.input and (all(isinstance(t, int) for t in body.input) or isinstance(body.input[0], list)):
        raise APIError(422, "input: token arrays are not supported; send text", "unsupported_input", "input")
    result = await _embed(request, texts, body, "input", listed)
    if isinstance(result, Response):
        return result
    if body.dimensions is not None and body.dimensions != len(result.vectors[0]):
        raise APIError(422, f"dimensions: this model produces {len(result.vectors[0])}-dimensional "
                       f"embeddings; {body.dimensions} was asked", "invalid_value", "dimensions")
    if body.encoding_format == "base64":
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")}
                for i, v in enumerate(result.vectors)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(result.vectors)]
    return json_response({"object": "list", "data": data, "model": _served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens,
                                    "total_tokens": result.prompt_tokens}})


@router.get("/v1/models")
async def models(request: Request) -> Response:
    settings = request.app.state.settings
    require_keys(request, settings.server.api_keys, "inference")
    data = []
    for role, slot in request.app.state.manager.slots():
        data.append({"id": f"{slot.spec.name}@{slot.version}", "object": "model",
                     "created": int(request.app.state.started_at), "owned_by": "inferd", "role": role})
    return json_response({"object": "list", "data": data})


@router.get("/info")
async def info(request: Request) -> Response:
    manager = request.app.state.manager
    out: dict[str, Any] = {"inferd_version": __version__, "state": manager.state, "models": []}
    for role, slot in manager.slots():
        h = slot.handler
        out["models"].append({
            "role": role, "name": slot.spec.name, "version": slot.version, "dimension": h.dimension,
            "max_seq_length": h.max_seq_length, "device": str(h.device), "dtype": h.dtype,
            "pooling": getattr(h, "pooling", None), "normalize": getattr(h, "normalize", None),
            "load_seconds": round(slot.load_seconds, 3),
            "weight": manager.canary_weight if role == "canary" else None})
    if out["models"]:
        out.update({k: out["models"][0][k] for k in ("name", "version", "dimension", "max_seq_length",
                                                     "device", "dtype")})
    return json_response(out)


def readiness(request: Request) -> tuple[int, dict[str, Any]]:
    state = request.app.state
    engine, manager = state.engine, state.manager
    if engine.draining:
        return 503, {"status": "draining"}
    if not engine.alive:
        return 503, {"status": "failed", "reason": f"inference worker: {engine.worker_error or 'stopped'}"}
    if manager.state == "ready":
        active = manager.active
        return 200, {"status": "ready", "model": active.spec.name if active else None,
                     "version": active.version if active else None}
    if manager.state == "failed":
        return 503, {"status": "failed", "reason": manager.reason}
    if manager.state == "not_loaded" and state.settings.model.load_mode == "lazy":
        # Lazy: the first request loads the model, so the instance must be routable before that.
        return 200, {"status": "ready", "loaded": False}
    return 503, {"status": "loading"}


@router.get("/health")
@router.get("/health/ready")
async def health_ready(request: Request) -> Response:
    status, body = readiness(request)
    return json_response(body, status, {"Retry-After": "1"} if status == 503 else None)


@router.get("/health/live")
async def health_live(request: Request) -> Response:
    engine = request.app.state.engine
    if not engine.alive and not engine.draining:
        return json_response({"status": "dead", "reason": engine.worker_error or "worker stopped"}, 503)
    return json_response({"status": "alive", "uptime_s": round(time.time() - request.app.state.started_at, 3)})
