"""HTTP routes: parse and validate, hand texts to the engine, shape the answer. No model work here."""

from __future__ import annotations

import base64
import gc
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from inferd import __version__
from inferd.api.errors import APIError, engine_refusal, excerpt
from inferd.api.middleware import context
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
from inferd.core.errors import ClientGone, EngineError, Kind
from inferd.core.work import TaskResult

# Inference, and what is served (/v1/models, /info): the inference keys, checked once for the whole router.
router = APIRouter(dependencies=[Depends(inference_auth)])
# Health answers load balancers and probes, which hold no key.
health_router = APIRouter()
B = TypeVar("B", bound=BaseModel)

_INFERENCE_ERRORS = (400, 401, 404, 413, 422, 503, 504, 507)


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


def _prechecked(request: Request, texts: Any, field: str, listed: bool) -> None:
    """The engine's model-free checks (types, counts, lengths), run while the body is parsed."""
    s = services(request)
    try:
        s.engine.precheck(texts)
    except EngineError as exc:
        raise engine_refusal(exc, field, listed, s.metrics) from None


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next message can only be the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def require_task(request: Request, task: str) -> None:
    """404 on a route of another task than the one this server serves, naming the served one."""
    served = services(request).manager.task
    if served is not None and served != task:
        raise APIError(404, f"{request.url.path} serves the {task} task; this server serves the {served} task",
                       "wrong_task")


def served_task(request: Request) -> str:
    return services(request).manager.task or "embedding"


async def run_task(request: Request, texts: list[Any], body: Any, field: str, listed: bool,
                   task: str | None = None, admit: Callable[[Any], None] | None = None) -> TaskResult | Response:
    """Hand a request's inputs to the engine; its refusals in the error shape, 499 for a client gone.

    ``field`` is the request field holding the inputs: an input at fault is named ``field[i]``.
    """
    s = services(request)
    if s.settings.server.log_inputs:
        # Only when the operator asked for it: request text is user data and stays out of logs by default.
        context(request.scope)["inputs"] = texts
    try:
        result = await s.engine.run(
            texts, priority=body.priority, timeout_ms=body.timeout_ms, model=getattr(body, "model", None), task=task,
            admit=admit, routing_key=request.headers.get("x-routing-key"),
            disconnected=lambda: _disconnected(request))
    except EngineError as exc:
        raise engine_refusal(exc, field, listed, s.metrics) from None
    except ClientGone:
        return Response(status_code=499)
    ctx = context(request.scope)
    ctx.update(result.timings)
    ctx["version"] = result.version
    return result


def served_name(result: TaskResult) -> str:
    return f"{result.model}@{result.version}"


@router.post("/predict", openapi_extra=request_body(PredictRequest),
             responses=responses(PredictResponse, *_INFERENCE_ERRORS))
async def predict(request: Request) -> Response:
    """The seed's endpoint, each task's natural result: ``{"texts": [...]}`` → ``{"results": [...], "model"}``.

    embedding: a vector per text; classification: ``{"label", "probs"}`` per text; rerank: ``texts`` holds
    ``[query, document]`` pairs and each gets its score.
    """
    task = served_task(request)
    if task == "rerank":
        from inferd.api.task_routes import predict_pairs

        return await predict_pairs(request)
    body = await read_body(request, PredictRequest, lambda b: _prechecked(request, b.texts, "texts", True))
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


@router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingsRequest),
             responses=responses(EmbeddingsResponse, *_INFERENCE_ERRORS))
async def embeddings(request: Request) -> Response:
    """OpenAI-compatible embeddings (the official ``openai`` client works against it)."""
    require_task(request, "embedding")
    body = await read_body(request, EmbeddingsRequest, lambda b: _check_input(request, b))
    listed = isinstance(body.input, list)
    texts = body.input if listed else [body.input]
    result = await run_task(request, texts, body, "input", listed, task="embedding",
                            admit=None if body.dimensions is None else _same_dimension(body.dimensions))
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


def _same_dimension(dimensions: int) -> Callable[[Any], None]:
    def admit(info: Any) -> None:
        dimension = info.get("dimension")
        if dimension is not None and dimensions != dimension:
            raise EngineError(Kind.INVALID_INPUT, f"this model produces {dimension}-dimensional embeddings; "
                              f"{dimensions} was asked", field="dimensions")
    return admit


def _check_input(request: Request, body: EmbeddingsRequest) -> None:
    listed = isinstance(body.input, list)
    # OpenAI also accepts token ids (a list of ints, or a list of such lists); this service takes text only.
    # The first item decides, in constant time: a long list of numbers must not be walked on the event loop.
    if listed and body.input and isinstance(body.input[0], int | list) and not isinstance(body.input[0], bool):
        raise APIError(422, "input: token arrays are not supported; send text", "unsupported_input", "input")
    _prechecked(request, body.input if listed else [body.input], "input", listed)


@router.get("/v1/models", responses=responses(ModelList, 401))
async def models(request: Request) -> Response:
    s = services(request)
    data = []
    for role, slot in s.manager.slots():
        data.append({"id": f"{slot.spec.name}@{slot.version}", "object": "model",
                     "created": int(s.started_at), "owned_by": "inferd", "role": role,
                     "task": slot.task})
    return json_response({"object": "list", "data": data})


@router.get("/info", responses=responses(Info, 401))
async def info(request: Request) -> Response:
    # What is served, on which device, with which limits: as much the inference keys' business as /v1/models
    # (the router checks them).
    manager = services(request).manager
    out: dict[str, Any] = {"inferd_version": __version__, "state": manager.state, "models": []}
    for role, slot in manager.slots():
        h = slot.handler
        out["models"].append({
            "role": role, "name": slot.spec.name, "version": slot.version, "task": slot.task,
            "labels": slot.info.get("labels"), "dimension": slot.info.get("dimension"),
            "max_seq_length": h.max_seq_length, "device": str(h.device), "dtype": h.dtype,
            "pooling": getattr(h, "pooling", None), "normalize": getattr(h, "normalize", None),
            "load_seconds": round(slot.load_seconds, 3),
            "weight": manager.canary_weight if role == "canary" else None,
            "backend": getattr(h, "backend", "torch"), "quantize": getattr(h, "quantize", "none"),
            "backend_info": getattr(h, "backend_info", None)})
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
