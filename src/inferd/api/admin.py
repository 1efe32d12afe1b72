"""Admin routes: model reload, canary, promote, rollback, shadow. Bearer ``server.admin_key``; 404 without one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat
from starlette.responses import Response

from inferd.api.answers import raw_body, responses
from inferd.api.bodies import json_response, read_body
from inferd.api.errors import APIError, refusal
from inferd.api.schemas import request_body
from inferd.api.services import admin_auth, services
from inferd.api.state_schemas import AdminModels, ModelChange
from inferd.core.errors import (
    Kind,
    LoadCancelled,
    ManagerClosed,
    ModelLoadError,
    ModelNotReady,
    NoCanary,
    NoLoadInProgress,
    NoShadow,
    ReloadInProgress,
    ShadowRefused,
    SpaceChanged,
    TaskMismatch,
    VersionInUse,
    excerpt,
)
from inferd.core.instances import Instance
from inferd.core.registry import ServedModel
from inferd.core.shadow import verdict
from inferd.core.slots import ModelSlot
from inferd.settings import Backend, Dtype, Quantize

log = logging.getLogger(__name__)


admin_router = APIRouter(prefix="/admin", dependencies=[Depends(admin_auth)])
# Every admin route: 401 without the key, 404 when no key is configured (the routes do not exist).
_CHANGE_ERRORS = (400, 401, 404, 409, 413, 422, 503)


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Which served model changes; may be left out when the server serves one model.
    model: str | None = Field(None, min_length=1, max_length=128)
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
    # An embedding canary of another space is refused (clients would index a mixture); true overrides, logged.
    force: StrictBool = False


class ShadowRequest(ReloadRequest):
    # The share of live requests mirrored to the candidate (per request, or per X-Routing-Key bucket).
    weight: StrictFloat = Field(ge=0.0, le=1.0, allow_inf_nan=False)


_OBJECT = raw_body("application/json", {"type": "object"})


def _describe(slot: ModelSlot) -> dict[str, Any]:
    d = slot.description
    return {"model": slot.spec.name, "name": d.name, "version": d.version, "path": d.path, "task": d.task,
            "dimension": d.dimension, "load_seconds": d.load_seconds}


def _served(request: Request, name: str | None) -> ServedModel:
    """The model a change is for: the one named, or the only one served (with several, it must be named)."""
    registry = services(request).registry
    names = ", ".join(registry.names())
    if name is None:
        if len(registry) == 1:
            return next(iter(registry))
        raise APIError(422, f"model: this server serves several models ({names}); name the one to change",
                       "model_required", "model")
    served = registry.get(name)
    if served is None:
        raise refusal(Kind.MODEL_NOT_FOUND, f"model {excerpt(name)!r} is not served here; the models served: {names}",
                      param="model")
    return served


# What a model change may raise: each says its kind, code and field (core/errors.py); KINDS answers the kind.
_REFUSALS = (ReloadInProgress, NoCanary, NoShadow, ShadowRefused, ModelNotReady, ModelLoadError)


def _refused(exc: Any, action: str, metrics: Any) -> APIError:
    """A refused change in the error shape, by its kind (status, Retry-After), counted and logged by outcome."""
    if isinstance(exc, ReloadInProgress):
        metrics.model_reloads.labels("conflict").inc()
        return refusal(exc.kind, f"{exc}; try again when it has finished", exc.code, exc.field)
    if isinstance(exc, ManagerClosed):
        return refusal(exc.kind, exc.reason or "the server is shutting down", exc.code, exc.field)
    if isinstance(exc, ModelNotReady):
        return refusal(exc.kind, f"no model is serving yet ({exc.state})", exc.code, exc.field)
    if isinstance(exc, LoadCancelled):
        metrics.model_reloads.labels("cancelled").inc()
        log.warning("%s cancelled: %s", action, exc, extra={"action": action})
        return refusal(exc.kind, f"{action} cancelled; the serving model is unchanged: {exc}", exc.code, exc.field)
    if isinstance(exc, ModelLoadError):
        metrics.model_reloads.labels("failed").inc()
        refused = isinstance(exc, SpaceChanged | VersionInUse | TaskMismatch)  # a rule refused it, not the load
        if refused:
            log.warning("%s refused: %s", action, exc, extra={"action": action})
        else:
            log.error("%s failed: %s", action, exc, extra={"action": action})
        return refusal(exc.kind, f"{action} {'refused' if refused else 'failed'}; the serving model is unchanged: "
                       f"{exc}", exc.code, exc.field)
    if isinstance(exc, ShadowRefused):
        log.warning("%s refused: %s", action, exc, extra={"action": action})
    return refusal(exc.kind, str(exc), exc.code, exc.field)


async def _change(request: Request, action: str, fn: Callable[..., ModelSlot], *args: Any) -> dict[str, Any]:
    """Run one model change in a thread (loading blocks); map each way it can fail onto the error shape."""
    metrics = services(request).metrics
    try:
        slot = await asyncio.to_thread(fn, *args)
    except _REFUSALS as exc:
        raise _refused(exc, action, metrics) from None
    metrics.model_reloads.labels("ok").inc()
    log.info("%s done", action, extra={"action": action, "version": slot.version})
    return _describe(slot)


@admin_router.post("/models/reload", openapi_extra=request_body(ReloadRequest),
                   responses=responses(ModelChange, *_CHANGE_ERRORS))
async def reload_model(request: Request) -> Response:
    body = await read_body(request, ReloadRequest)
    manager = _served(request, body.model).manager
    slot = await _change(request, "reload", manager.reload, body.path, body.version, body.runtime())
    return json_response({"status": "switched", "active": slot, "switches": manager.switches})


@admin_router.post("/models/reload/cancel", responses=responses(_OBJECT, 401, 404, 409, 422))
async def cancel_load(request: Request, model: str | None = None) -> Response:
    """Abandon the model change of ``?model=NAME`` (or of the only model) still loading: a reload, canary, shadow or
    SIGHUP. It answers 409 ``load_cancelled`` with the serving model unchanged, and the next change may start at
    once; the abandoned load stops at its next stage (core/load_guard.py). 409 ``no_load_in_progress`` when none
    is loading."""
    served = _served(request, model)
    try:
        guard = served.manager.cancel_load()
    except NoLoadInProgress as exc:
        raise refusal(exc.kind, str(exc), exc.code, exc.field) from None
    return json_response({"status": "cancelled", "model": served.name, **guard.describe()})


@admin_router.post("/models/canary", openapi_extra=request_body(CanaryRequest),
                   responses=responses(ModelChange, *_CHANGE_ERRORS))
async def canary(request: Request) -> Response:
    body = await read_body(request, CanaryRequest)
    manager = _served(request, body.model).manager
    slot = await _change(request, "canary", manager.set_canary, body.path, body.version, body.weight,
                         body.runtime(), body.force)
    return json_response({"status": "canary", "canary": slot, "weight": manager.canary_weight})


@admin_router.post("/models/promote", responses=responses(ModelChange, 401, 404, 409, 422, 503))
async def promote(request: Request, model: str | None = None) -> Response:
    """The canary of ``?model=NAME`` (or of the only model) becomes its active model."""
    slot = await _change(request, "promote", _served(request, model).manager.promote)
    return json_response({"status": "promoted", "active": slot})


@admin_router.post("/models/rollback", responses=responses(ModelChange, 401, 404, 409, 422, 503))
async def rollback(request: Request, model: str | None = None) -> Response:
    """Drop the canary of ``?model=NAME`` (or of the only model)."""
    slot = await _change(request, "rollback", _served(request, model).manager.rollback)
    return json_response({"status": "rolled_back", "active": slot})


# -- shadow (core/shadow.py) ----------------------------------------------------------------------------


def _min_items(served: ServedModel) -> int:
    return served.settings.shadow.min_items


def _shadow_state(served: ServedModel) -> dict[str, Any]:
    shadow = served.manager.shadow
    if shadow is None:
        raise APIError(404, f"model {served.name!r} has no shadow candidate; POST /admin/models/shadow sets one",
                       "no_shadow", "model")
    report = shadow.report.as_dict()
    decided = verdict(shadow.report.task, report["items"], report["figures"], served.settings.model.gate,
                      _min_items(served))
    return {"status": "shadow", "model": served.name, "shadow": _describe(shadow.slot), "weight": shadow.weight,
            "report": report, "verdict": {"promote": decided.ok, "code": decided.code, "reasons": decided.reasons,
                                          "min_items": _min_items(served)}}


@admin_router.post("/models/shadow", openapi_extra=request_body(ShadowRequest),
                   responses=responses(_OBJECT, *_CHANGE_ERRORS))
async def shadow(request: Request) -> Response:
    """Load a candidate beside the active model; ``weight`` of live requests is also computed on it, off the
    response path, and compared (GET /admin/models/shadow)."""
    body = await read_body(request, ShadowRequest)
    served = _served(request, body.model)
    slot = await _change(request, "shadow", served.manager.set_shadow, body.path, body.version, body.weight,
                         body.runtime())
    services(request).metrics.forget_shadow(served.name)
    return json_response({"status": "shadow", "model": served.name, "shadow": slot, "weight": body.weight})


@admin_router.get("/models/shadow", responses=responses(_OBJECT, 401, 404, 422))
async def shadow_report(request: Request, model: str | None = None) -> Response:
    """The drift report of ``?model=NAME``'s shadow candidate (or the only model's), and its verdict."""
    return json_response(_shadow_state(_served(request, model)))


@admin_router.delete("/models/shadow", responses=responses(_OBJECT, 401, 404, 409, 422, 503))
async def drop_shadow(request: Request, model: str | None = None) -> Response:
    """Stop shadowing; answers the candidate's final report."""
    served = _served(request, model)
    state = _shadow_state(served) if served.manager.shadow is not None else None
    slot = await _change(request, "shadow drop", lambda: served.manager.drop_shadow().slot)
    services(request).metrics.forget_shadow(served.name)
    return json_response({"status": "dropped", "model": served.name, "shadow": slot,
                          "report": state["report"] if state else None})


@admin_router.post("/models/shadow/promote", responses=responses(_OBJECT, 401, 404, 409, 422, 503))
async def promote_shadow(request: Request, model: str | None = None, force: bool = False) -> Response:
    """The shadow candidate becomes the active model, if its drift report allows it: refused (409
    ``shadow_drifted`` / ``shadow_insufficient``, naming the figure and its bound) unless ``force=true``."""
    served = _served(request, model)
    if force:
        log.warning("shadow promotion forced", extra={"model": served.name})
    slot = await _change(request, "shadow promote", served.manager.promote_shadow, force, _min_items(served))
    services(request).metrics.forget_shadow(served.name)
    return json_response({"status": "promoted", "model": served.name, "active": slot})


@admin_router.get("/models", responses=responses(AdminModels, 401, 404, 422))
async def list_models(request: Request, model: str | None = None) -> Response:
    """Every model's slots, and the causes that public health answers only name (a failed load, a dead worker).

    ``models`` has one entry per served model; the top-level state, switches, canary weight, slots and reason
    are the default model's (a single-model server's), ``?model=NAME`` makes them that model's.
    """
    s = services(request)
    rows = [{**_admin_row(m, s.engine.queue_depth(m.name)),
             "instances": [_instance_row(i) for i in s.engine.instances(m.name)]} for m in s.registry]
    chosen = _served(request, model) if model is not None else s.registry.first()
    top = next((r for r in rows if chosen is not None and r["name"] == chosen.name), {})
    return json_response({**{k: top.get(k) for k in ("state", "switches", "canary_weight", "slots", "reason")},
                          "model": top.get("name"), "models": rows, "worker_error": s.engine.worker_error,
                          "shadow_instance": _instance_row(s.engine.shadow_instance)})


def _instance_row(instance: Instance) -> dict[str, Any]:
    """A worker of a model (core/instances.py): its budget, and what it has run since start."""
    return {"index": instance.index, "threads": instance.threads, "stream": instance.stream is not None,
            "batches": instance.batches, "busy_seconds": round(instance.busy_s, 6)}


def _admin_row(served: ServedModel, queue_depth: int) -> dict[str, Any]:
    manager, shadow = served.manager, served.manager.shadow
    return {"name": served.name, "task": served.task, "required": served.required, "state": manager.state,
            "switches": manager.switches, "canary_weight": manager.canary_weight, "reason": manager.reason,
            "queue_depth": queue_depth,
            # The change loading now (its action, stage and age), which POST /admin/models/reload/cancel abandons.
            "loading": None if manager.loading is None else manager.loading.describe(),
            "slots": [{"role": role, **_describe(s), "in_use": s.refs} for role, s in manager.slots()],
            # The candidate computes beside the active model but answers nobody: not a serving slot.
            "shadow": None if shadow is None else {**_describe(shadow.slot), "in_use": shadow.slot.refs,
                                                   "weight": shadow.weight}}


@admin_router.get("/usage", responses=responses(raw_body("application/json", {"type": "object"}), 401, 404))
async def usage(request: Request) -> Response:
    """Per tenant served now, since start (or since a SIGHUP added it): per model the requests answered and the
    tokens the model ran for them, the refusals by the tenant's own limits by reason, the requests running."""
    return json_response({"tenants": services(request).tenancy.report()})


@admin_router.get("/memory", responses=responses(raw_body("application/json", {"type": "object"}), 401, 404))
async def memory(request: Request) -> Response:
    """The memory guard's figures; on a GPU also ``torch.cuda.memory_summary()`` (in a thread: it locks)."""
    report = await asyncio.to_thread(services(request).memory_guard.report)
    return json_response(report)
