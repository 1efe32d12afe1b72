"""Managed platforms' routes, beside every other route (``server.platform``: inferd/hosting.py names or detects
it), as text-embeddings-inference answers them (its router/src/http/server.rs is the reference):

- **Amazon SageMaker**: ``GET /ping`` is readiness (200 once the models are ready, 503 before); ``POST
  /invocations`` is TEI's ``POST /``, by the served (default) model's task: an embedding model's ``/embed``, a
  reranker's ``/rerank``, a classifier's ``/predict``.
- **Google Vertex AI**: ``POST AIP_PREDICT_ROUTE`` takes ``{"instances": [...]}`` and answers ``{"predictions":
  [...]}``, one per instance, in order. An instance is a TEI request body: one with ``query`` and ``texts`` is a
  ``/rerank``; any other is the served model's task's (``/embed``, ``/predict``), and its prediction is that route's
  answer. The instances run at once, each its own engine request (their texts batch together); the first refused
  refuses the whole request with its status and TEI's error. ``GET AIP_HEALTH_ROUTE`` is readiness.

The predict routes need the inference keys as every inference route does (the platforms authenticate their callers
themselves and send no key: leave ``server.api_keys`` unset there); the health routes are public, as /health.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response
from starlette.types import Message

from inferd.api.bodies import json_response
from inferd.api.errors import APIError, refusal
from inferd.api.health import readiness
from inferd.api.services import inference_auth
from inferd.api.tei import rerank, root
from inferd.api.tei_shape import tei_error
from inferd.core.errors import Kind
from inferd.settings import Settings


async def ready(request: Request) -> Response:
    """The platform's health check: readiness (every required model ready), as /health/ready."""
    status, body = readiness(request)
    return json_response(body, status, {"Retry-After": "1"} if status == 503 else None)


async def invocations(request: Request) -> Response:
    """SageMaker's invocation: TEI's ``POST /`` (its SageMaker route), by the served model's task."""
    return await root(request)


def _instances(raw: bytes) -> list[dict[str, Any]]:
    try:
        data = orjson.loads(raw) if raw.strip() else None
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    instances = data.get("instances") if isinstance(data, dict) else None
    if not isinstance(instances, list) or not instances:
        raise refusal(Kind.INVALID_INPUT, "instances: a Vertex AI request is {\"instances\": [...]}, at least one",
                      "invalid_value", "instances")
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise refusal(Kind.INVALID_INPUT, f"instances[{i}]: must be an object (a request body: /embed's, "
                          "/rerank's or /predict's)", "invalid_type", f"instances[{i}]")
    return instances


def _replayed(body: bytes, gone: asyncio.Event) -> Callable[[], Awaitable[Message]]:
    """An instance's own receive: its body, then the client going away when the request's client does."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def _watch(request: Request, gone: asyncio.Event) -> None:
    # The body is read, so the next message can only be the client going away (one reader for every instance).
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def vertex_predict(request: Request) -> Response:
    """Vertex AI's prediction: each instance as the TEI route its body is for, answered in order."""
    try:
        instances = _instances(await request.body())
    except APIError as exc:
        return tei_error(exc)
    gone = asyncio.Event()
    watcher = asyncio.create_task(_watch(request, gone))

    async def one(instance: dict[str, Any]) -> Response:
        sub = Request(request.scope, _replayed(orjson.dumps(instance), gone))
        route = rerank if "query" in instance and "texts" in instance else root
        return await route(sub)

    try:
        answers = await asyncio.gather(*(one(i) for i in instances))
    finally:
        watcher.cancel()
    refused = next((a for a in answers if a.status_code != 200), None)
    if refused is not None:
        return refused
    return json_response({"predictions": [orjson.loads(bytes(a.body)) for a in answers]})


def platform_routers(settings: Settings) -> list[APIRouter]:
    """The platform's routes (none without one): its health route public, its predict route behind the
    inference keys. The app includes them first, so a platform's route wins over a native one of the same path."""
    server = settings.server
    public, keyed = APIRouter(), APIRouter(dependencies=[Depends(inference_auth)])
    if server.platform == "sagemaker":
        public.add_api_route("/ping", ready, methods=["GET"])
        keyed.add_api_route("/invocations", invocations, methods=["POST"])
    elif server.platform == "vertex":
        if server.platform_health_route:
            public.add_api_route(server.platform_health_route, ready, methods=["GET"])
        keyed.add_api_route(server.platform_predict_route, vertex_predict, methods=["POST"])
    else:
        return []
    return [public, keyed]
