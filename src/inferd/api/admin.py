"""Admin routes: model reload, canary, promote, rollback. Bearer ``server.admin_key``; 404 without one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictFloat
from starlette.responses import Response

from inferd.api.bodies import json_response, read_body
from inferd.api.errors import APIError
from inferd.api.schemas import AdminModels, ModelChange, raw_body, request_body, responses
from inferd.api.services import admin_auth, services
from inferd.config import Backend, Dtype, Quantize
from inferd.core.errors import ModelLoadError
from inferd.core.manager import (
    ManagerClosed,
    ModelNotReady,
    NoCanary,
    ReloadInProgress,
    TaskMismatch,
    VersionInUse,
)
from inferd.core.slots import ModelSlot

log = logging.getLogger(__name__)


admin_router = APIRouter(prefix="/admin", dependencies=[Depends(admin_auth)])
# Every admin route: 401 without the key, 404 when no key is configured (the routes do not exist).
_CHANGE_ERRORS = (400, 401, 404, 409, 413, 422, 503)


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    version: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")
    # The runtime for this load only (a canary on int8 beside an active model on bf16); unset = the configured one.
    backend: Backend | None = None
    dtype: Dtype | None = None
    quantize: Quantize | None = None

    def runtime(self) -> dict[str, str]:
        return {k: v for k in ("backend", "dtype", "quantize") if (v := getattr(self, k)) is not None}


class CanaryRequest(ReloadRequest):
    weight: StrictFloat = Field(ge=0.0, le=1.0, allow_inf_nan=False)  # strict: JSON false is not 0.0


def _describe(slot: ModelSlot) -> dict[str, Any]:
    return {k: slot.info.get(k) for k in ("name", "version", "path", "task", "dimension", "load_seconds")}


async def _change(request: Request, action: str, fn: Callable[..., ModelSlot], *args: Any) -> dict[str, Any]:
    """Run one model change in a thread (loading blocks); map each way it can fail onto the error shape."""
    metrics = services(request).metrics
    try:
        slot = await asyncio.to_thread(fn, *args)
    except ReloadInProgress as exc:
        metrics.model_reloads.labels("conflict").inc()
        raise APIError(409, f"{exc}; try again when it has finished", "reload_in_progress") from None
    except NoCanary as exc:
        raise APIError(409, str(exc), "no_canary") from None
    except VersionInUse as exc:
        metrics.model_reloads.labels("failed").inc()
        log.warning("%s refused: %s", action, exc, extra={"action": action})
        raise APIError(409, f"{action} refused; the serving model is unchanged: {exc}", "version_in_use",
                       "version") from None
    except TaskMismatch as exc:
        metrics.model_reloads.labels("failed").inc()
        log.warning("%s refused: %s", action, exc, extra={"action": action})
        raise APIError(409, f"{action} refused; the serving model is unchanged: {exc}", "task_mismatch",
                       "path") from None
    except ManagerClosed as exc:
        raise APIError(503, exc.reason or "the server is shutting down", "draining",
                       headers={"Retry-After": "1"}) from None
    except ModelNotReady as exc:
        raise APIError(503, f"no model is serving yet ({exc.state})", "model_not_ready",
                       headers={"Retry-After": "1"}) from None
    except ModelLoadError as exc:
        metrics.model_reloads.labels("failed").inc()
        log.error("%s failed: %s", action, exc, extra={"action": action})
        raise APIError(422, f"{action} failed; the serving model is unchanged: {exc}",
                       "model_load_failed", "path") from None
    metrics.model_reloads.labels("ok").inc()
    log.info("%s done", action, extra={"action": action, "version": slot.version})
    return _describe(slot)


@admin_router.post("/models/reload", openapi_extra=request_body(ReloadRequest),
                   responses=responses(ModelChange, *_CHANGE_ERRORS))
async def reload_model(request: Request) -> Response:
    body = await read_body(request, ReloadRequest)
    manager = services(request).manager
    slot = await _change(request, "reload", manager.reload, body.path, body.version, body.runtime())
    return json_response({"status": "switched", "active": slot, "switches": manager.switches})


@admin_router.post("/models/canary", openapi_extra=request_body(CanaryRequest),
                   responses=responses(ModelChange, *_CHANGE_ERRORS))
async def canary(request: Request) -> Response:
    body = await read_body(request, CanaryRequest)
    manager = services(request).manager
    slot = await _change(request, "canary", manager.set_canary, body.path, body.version, body.weight,
                         body.runtime())
    return json_response({"status": "canary", "canary": slot, "weight": manager.canary_weight})


@admin_router.post("/models/promote", responses=responses(ModelChange, 401, 404, 409, 503))
async def promote(request: Request) -> Response:
    slot = await _change(request, "promote", services(request).manager.promote)
    return json_response({"status": "promoted", "active": slot})


@admin_router.post("/models/rollback", responses=responses(ModelChange, 401, 404, 409, 503))
async def rollback(request: Request) -> Response:
    slot = await _change(request, "rollback", services(request).manager.rollback)
    return json_response({"status": "rolled_back", "active": slot})


@admin_router.get("/models", responses=responses(AdminModels, 401, 404))
async def list_models(request: Request) -> Response:
    """The slots, and the causes that public health answers only name (a failed load, a dead worker)."""
    manager, engine = services(request).manager, services(request).engine
    return json_response({"state": manager.state, "switches": manager.switches,
                          "canary_weight": manager.canary_weight,
                          "slots": [{"role": role, **_describe(s), "in_use": s.refs}
                                    for role, s in manager.slots()],
                          "reason": manager.reason, "worker_error": engine.worker_error})


@admin_router.get("/memory", responses=responses(raw_body("application/json", {"type": "object"}), 401, 404))
async def memory(request: Request) -> Response:
    """The memory guard's figures; on a GPU also ``torch.cuda.memory_summary()`` (in a thread: it locks)."""
    report = await asyncio.to_thread(services(request).memory_guard.report)
    return json_response(report)
