"""What every inference route shares: the engine's request built while the body is parsed (``read_request``,
``build``: core/request.py's rules, refusals named in the route's own words by api/errors.py Names), the task a
route serves, the one engine call (``ask_engine``), and the name of the model that answered.

The route modules of each client family (api/openai.py, api/cohere.py, api/tei*.py, api/inferd_routes.py,
api/inferd_encode.py) build on these and never on each other; none reaches into a model's manager or slots: what a
route shapes an answer by travels with the result (its description, its calibration).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from inferd.api.bodies import read_body
from inferd.api.errors import Names, engine_refusal
from inferd.api.middleware import context
from inferd.api.services import services
from inferd.core.errors import EngineError
from inferd.core.outcomes import TaskResult
from inferd.core.request import InferenceRequest
from inferd.core.tasks.kinds import EMBEDDING, task_of
from inferd.core.tasks.task import Task
from inferd.core.tenants import current_tenant

B = TypeVar("B", bound=BaseModel)

# The statuses an inference route may answer (its OpenAPI ``responses``).
INFERENCE_ERRORS = (400, 401, 404, 413, 422, 503, 504, 507)


def build(request: Request, inputs: Any, names: Names, **options: Any) -> InferenceRequest:
    """The engine's request, every rule that needs no model checked (core/request.py), its refusals named by
    ``names``; run while the body is parsed (read_body's check), so a refused body never outlives parsing.
    ``options`` are InferenceRequest.build's; the routing key is the ``X-Routing-Key`` header's, the tenant the
    one the key check found (api/security.py require_tenant)."""
    s = services(request)
    try:
        return s.engine.request(inputs, routing_key=request.headers.get("x-routing-key"),
                                tenant=current_tenant.get(), **options)
    except EngineError as exc:
        raise engine_refusal(exc, names, s.metrics) from None


async def read_request(request: Request, schema: type[B], make: Callable[[B], InferenceRequest]
                       ) -> tuple[B, InferenceRequest]:
    """The body, parsed and validated (api/bodies.py read_body), and the engine's request ``make`` builds of it
    (with ``build``) while the body is parsed."""
    built: list[InferenceRequest] = []
    body = await read_body(request, schema, lambda b: built.append(make(b)))
    return body, built[0]


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next message can only be the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def require_task(request: Request, task: str) -> None:
    """404 on a route of a task no model here serves, naming the tasks served (before the body is read)."""
    try:
        services(request).registry.require_task(task)
    except EngineError as exc:
        raise engine_refusal(exc, Names("model")) from None


def model_task(request: Request, model: str | None) -> Task:
    """The task of the model a request names (or of the server's default model; an embedding's while it is not
    known until the model loads): /predict's shape follows it."""
    try:
        name = services(request).registry.task_of(model)
    except EngineError as exc:
        raise engine_refusal(exc, Names("model")) from None
    return task_of(name) if name else EMBEDDING


async def ask_engine(request: Request, engine_request: InferenceRequest, names: Names) -> TaskResult:
    """The one engine call: its refusals in the error shape (APIError, named by ``names``); a client gone
    propagates as ClientGone (api/errors.py answers it 499)."""
    s = services(request)
    if s.settings.server.log_inputs:
        # Only when the operator asked for it: request text is user data and stays out of logs by default.
        context(request.scope)["inputs"] = list(engine_request.inputs)
    try:
        result = await s.engine.process(engine_request, disconnected=lambda: _disconnected(request))
    except EngineError as exc:
        if exc.model is not None:
            context(request.scope)["model"] = exc.model
        raise engine_refusal(exc, names, s.metrics) from None
    ctx = context(request.scope)
    ctx.update(result.timings)
    ctx["model"], ctx["version"] = result.model, result.version
    ctx["runtime"] = result.description.runtime  # which runtime answered (backend auto switches under traffic)
    ctx["tokens"] = result.prompt_tokens  # the access line's and the trace's token count
    return result


def served_name(result: TaskResult) -> str:
    return f"{result.model}@{result.version}"
