"""Readiness and liveness: ``/health`` (= ``/health/ready``, ``?model=NAME`` for one model) and ``/health/live``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from inferd.api.answers import responses
from inferd.api.bodies import json_response
from inferd.api.errors import refusal
from inferd.api.services import services
from inferd.api.state_schemas import Health
from inferd.core.errors import Kind, excerpt
from inferd.core.registry import ServedModel

# Health answers load balancers and probes, which hold no key.
health_router = APIRouter()


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
            raise refusal(Kind.MODEL_NOT_FOUND, f"model {excerpt(model)!r} is not served here; the models served: "
                          f"{', '.join(s.registry.names())}", param="model")
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
