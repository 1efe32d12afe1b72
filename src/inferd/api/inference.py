"""The steps every inference route shares: the engine's checks while the body is parsed, the task the route
serves, the hand-off of a request's inputs to the engine, and the name of the model that answered.

The routes of each wire API (api/routes.py: the seed's /predict and OpenAI's embeddings; api/task_routes.py:
the rerank and classification shapes) build on these and never on each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import Request
from starlette.responses import Response

from inferd.api.errors import APIError, engine_refusal
from inferd.api.middleware import context
from inferd.api.services import services
from inferd.core.errors import ClientGone, EngineError
from inferd.core.prompts import Prompt
from inferd.core.registry import ModelNotFound
from inferd.core.work import TaskResult

# The statuses an inference route may answer (its OpenAPI ``responses``).
INFERENCE_ERRORS = (400, 401, 404, 413, 422, 503, 504, 507)


def prechecked(request: Request, texts: Any, field: str, listed: bool) -> None:
    """The engine's model-free checks (types, counts, lengths), run while the body is parsed."""
    s = services(request)
    try:
        s.engine.precheck(texts)
    except EngineError as exc:
        raise engine_refusal(exc, field, listed, s.metrics) from None


def check_query(request: Request, query: Any, field: str = "query") -> str:
    """A rerank query is one text shared by every pair: the same rules as a text, named by its own field."""
    limit = services(request).settings.limits.max_chars_per_text
    if not isinstance(query, str):
        raise APIError(422, f"{field}: must be a string, not {type(query).__name__}", "invalid_type", field)
    if not query.strip():
        raise APIError(422, f"{field}: must not be empty or only whitespace", "empty_string", field)
    if len(query) > limit:
        raise APIError(422, f"{field}: is {len(query)} characters long; the limit is {limit}", "text_too_long",
                       field)
    return query


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next message can only be the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def require_task(request: Request, task: str) -> None:
    """404 on a route of a task no model here serves, naming the tasks served (before the body is read)."""
    tasks = [m.task for m in services(request).registry]
    if task not in tasks and None not in tasks:
        served = ", ".join(dict.fromkeys(t for t in tasks if t)) or "no"
        raise APIError(404, f"{request.url.path} serves the {task} task; this server serves the {served} task",
                       "wrong_task")


def task_of(request: Request, model: str | None) -> str:
    """The task of the model a request names (or of the server's default model): /predict's shape follows it."""
    try:
        served, _ = services(request).registry.resolve(model, None)
    except ModelNotFound as exc:
        raise APIError(404, exc.message, "model_not_found", "model") from None
    return served.task or "embedding"


async def run_task(request: Request, texts: list[Any], body: Any, field: str, listed: bool,
                   task: str | None = None, dimensions: int | None = None, prompt: Prompt | None = None,
                   calibrate: bool = False, fields: Mapping[str, str] | None = None) -> TaskResult | Response:
    """Hand a request's inputs to the engine; its refusals in the error shape, 499 for a client gone.

    ``field`` is the request field holding the inputs: an input at fault is named ``field[i]``.
    ``dimensions`` is the embedding size the client asked for, refused by the engine unless the model
    produces it; ``prompt`` the prompt the texts get on the model that runs them; ``calibrate`` asks for the
    int8/uint8 calibration vectors with the result. ``fields`` renames the engine's fields into the route's
    (Cohere's ``dimensions`` is ``output_dimension``).
    """
    s = services(request)
    if s.settings.server.log_inputs:
        # Only when the operator asked for it: request text is user data and stays out of logs by default.
        context(request.scope)["inputs"] = texts
    try:
        result = await s.engine.run(
            texts, priority=body.priority, timeout_ms=body.timeout_ms, model=getattr(body, "model", None), task=task,
            dimensions=dimensions, prompt=prompt, calibrate=calibrate, routing_key=request.headers.get("x-routing-key"),
            disconnected=lambda: _disconnected(request))
    except EngineError as exc:
        if exc.model is not None:
            context(request.scope)["model"] = exc.model
        if fields and exc.field in fields:
            exc.field = fields[exc.field]
        raise engine_refusal(exc, field, listed, s.metrics) from None
    except ClientGone:
        return Response(status_code=499)
    ctx = context(request.scope)
    ctx.update(result.timings)
    ctx["model"], ctx["version"] = result.model, result.version
    ctx["tokens"] = result.prompt_tokens  # the access line's and the trace's token count
    return result


def served_name(result: TaskResult) -> str:
    return f"{result.model}@{result.version}"
