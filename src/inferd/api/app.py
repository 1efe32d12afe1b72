"""create_app: wires settings, model manager, engine, metrics and routes; the lifespan loads the model."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from inferd import __version__
from inferd.api.admin import admin_router
from inferd.api.answers import raw_body, responses
from inferd.api.batch_files import files_router, runner_of
from inferd.api.batches import batches_router
from inferd.api.catalog import catalog_router
from inferd.api.cohere import cohere_router
from inferd.api.docs import docs_router
from inferd.api.documents import DOCUMENT_PATHS
from inferd.api.errors import install_error_handlers
from inferd.api.health import health_router
from inferd.api.inferd_encode import encode_router
from inferd.api.inferd_routes import router
from inferd.api.middleware import BodyLimitMiddleware, RequestContextMiddleware
from inferd.api.oip import oip_health_router, oip_router
from inferd.api.openai import openai_router
from inferd.api.platforms import platform_routers
from inferd.api.security import require_keys
from inferd.api.services import Services, services, services_of
from inferd.api.tei import tei_router
from inferd.api.tei_outputs import tei_outputs_router
from inferd.api.tei_tokens import tei_tokens_router
from inferd.core.engine import InferenceEngine
from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.manager import ModelManager
from inferd.core.memory import build_guard
from inferd.core.registry import ServedModel
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler
from inferd.core.tenants import Tenancy
from inferd.grpc.oip import oip_services
from inferd.grpc.server import GrpcServer, Registration, tei_services
from inferd.jobs.runner import JobRunner
from inferd.settings import Settings
from inferd.utils.metrics import AutoCollector, Metrics

log = logging.getLogger(__name__)

# The gRPC services of each wire family, on one server (server.grpc_port): a family adds its registration here.
GRPC_FAMILIES: tuple[Registration, ...] = (tei_services, oip_services)
# Seconds the gRPC calls still open at the stop get: the drain has answered the work they had queued.
GRPC_STOP_GRACE_S = 1.0


class LoadFailed(SystemExit):
    """Raised out of start-up when the model fails and ``model.exit_on_load_failure`` is set."""


metrics_router = APIRouter()
# No trailing-slash redirect: the router answered one before any route's key check, built from the Host header
# (`GET /admin/models/` with `Host: evil.example` -> 307 to http://evil.example/admin/models, no key asked); a
# path with a slash too many is a 404 like any unknown path. The documentation is api/docs.py's, keyed.
_NO_BUILT_INS: dict[str, Any] = {"redirect_slashes": False, "openapi_url": None, "docs_url": None, "redoc_url": None,
                                 # No FastAPI native telemetry: inferd's own spans are the server spans
                                 # (utils/tracing.py), and asking whether a global provider is set cost every
                                 # request three environment look-ups.
                                 "telemetry": {"tracing": False, "metrics": False, "logs": False}}


@metrics_router.get("/metrics", responses=responses(raw_body(CONTENT_TYPE_LATEST, {"type": "string"}), 401))
async def metrics_endpoint(request: Request) -> Response:
    s = services(request)
    key = s.settings.server.metrics_key
    require_keys(request, (key,) if key else (), "metrics", s.metrics)
    return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _routers(settings: Settings, admin: bool = False) -> list[APIRouter]:
    """The routers of the main app (``admin``: of the admin app), in the order they are included."""
    if admin:
        return [admin_router]
    own_port = settings.server.admin_port is not None  # then the admin routes are the admin app's only
    # One module per client family (api/*.py), none importing another.
    # A managed platform's routes (api/platforms.py) come first: its predict route wins over a native one's path.
    return [*platform_routers(settings),
            router, encode_router, openai_router, catalog_router, cohere_router, tei_router, tei_tokens_router,
            tei_outputs_router, oip_router, oip_health_router, health_router,
            *([files_router, batches_router] if settings.jobs.enabled else []),
            *([] if own_port else [admin_router]), metrics_router]


def route_paths(settings: Settings, admin: bool = False) -> frozenset[str]:
    """The paths the main app (``admin``: the admin app) serves, a route with parameters by its template
    (``/v2/models/{name}/infer``): the request metrics' endpoint labels, any other path being one label, "other", so
    404 scans cannot explode the series."""
    return frozenset(route.path_format for included in _routers(settings, admin) for route in included.routes
                     if isinstance(route, APIRoute))


def _publish_models(slots: list[tuple[str, str, ModelSlot]], metrics: Metrics) -> None:
    """Every model's served slots as the info, gate and load series (after any model's change: all of them)."""
    metrics.model_info.clear()
    metrics.model_gate.clear()
    for model, role, slot in slots:
        d = slot.description  # built at load (core/slots.py)
        metrics.model_info.labels(model, role, d.version, d.device, d.dtype, d.backend, d.quantize, d.task).set(1)
        gate = (d.backend_info or {}).get("gate") or {}
        for figure, value in (gate.get("figures") or {}).items():
            # Every figure of the task's gate (cosines and overlap; rank and label agreement, differences).
            if isinstance(value, int | float) and not isinstance(value, bool) and figure != "texts":
                metrics.model_gate.labels(model, slot.version, figure).set(value)
        metrics.model_load.labels(model, slot.version).set(slot.load_seconds)


def create_app(settings: Settings, loader: Callable[[ModelSpec], Handler] = load_handler,
               memory_guard: Any = None) -> FastAPI:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub, whatever a library tries
    metrics = Metrics(settings.batching.max_batch_size)
    if memory_guard is None:
        # Tests and embedders that pass no guard still get one (and /admin/memory); no process-wide settings.
        memory_guard = build_guard(settings)
    memory_guard.bind(metrics)
    engine = InferenceEngine(settings, metrics, memory_guard, loader=loader,
                             on_change=functools.partial(_publish_models, metrics=metrics),
                             on_lazy_failure=_exit_soon)

    # backend auto's verdicts per model, read at each scrape (what serves is inferd_model_info's backend).
    metrics.registry.register(AutoCollector(lambda: [(m.name, m.manager.auto.describe()["candidates"])
                                                     for m in engine.registry if m.manager.auto is not None]))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # Eager models load before the server listens; background ones after, one at a time in the list's
        # order (loading several at once would only compete for the same cores); lazy ones on first use.
        models = list(engine.registry)
        for served in models:
            if served.settings.model.load_mode == "eager":
                await _load(served.manager, served.settings)
        background = [m for m in models if m.settings.model.load_mode == "background"]
        task = asyncio.create_task(_load_all(background)) if background else None
        jobs = runner_of(app)
        if jobs is not None:
            await jobs.start()
        # gRPC listens once the eager models are loaded, as HTTP does (grpc/server.py; server.grpc_port).
        grpc_server = GrpcServer(app, GRPC_FAMILIES) if settings.server.grpc_port is not None else None
        if grpc_server is not None:
            await grpc_server.start()
        try:
            yield
        finally:
            if grpc_server is not None:
                # After the SIGTERM drain (its calls answered, or refused as draining): new calls are refused.
                await grpc_server.stop(GRPC_STOP_GRACE_S)
            if jobs is not None:
                await jobs.stop()  # before the drain: the chunks it held go back to the store, for any worker
            if task is not None and not task.done():
                task.cancel()
            await engine.drain(settings.server.drain_timeout_s)
            engine.stop()
            engine.close()

    app = FastAPI(title="inferd", version=__version__, lifespan=lifespan, **_NO_BUILT_INS)
    tenancy = Tenancy(settings, metrics)
    app.state.services = Services(settings=settings, engine=engine, metrics=metrics,
                                  memory_guard=memory_guard, started_at=time.time(), tenancy=tenancy)
    # Not a service: the runner runs lines through this app's routes, which read the services (api/batch_files.py
    # runner_of reads it).
    app.state.jobs = JobRunner(settings.jobs, app, tenancy, metrics) if settings.jobs.enabled else None
    install_error_handlers(app)
    for included in _routers(settings):
        app.include_router(included)
    app.include_router(docs_router(app.title, [r for r in _routers(settings) if r is not admin_router]))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes,
                       larger={**dict.fromkeys(DOCUMENT_PATHS, max(settings.limits.max_document_body_bytes,
                                                                   settings.limits.max_body_bytes)),
                               # The file and the form around it: the route refuses a file over max_file_bytes
                               # by that setting's name, which this bound alone could not (it counts the form too).
                               "/v1/files": max(settings.jobs.max_file_bytes + 65536,
                                                settings.limits.max_body_bytes)})
    app.add_middleware(RequestContextMiddleware, metrics=metrics, paths=route_paths(settings),
                       access=settings.server.access_log)
    return app


def create_admin_app(main: FastAPI) -> FastAPI:
    """The admin routes on their own app (for ``server.admin_port``), sharing the main app's state."""
    app = FastAPI(title="inferd admin", version=__version__, **_NO_BUILT_INS)
    # The same State object: assigning to app.state._state would only store a key named "_state".
    app.state = main.state
    install_error_handlers(app)
    shared = services_of(main)
    for included in _routers(shared.settings, admin=True):
        app.include_router(included)
    app.include_router(docs_router(app.title, _routers(shared.settings, admin=True), admin=True))
    # The same body limit as the main port: the admin port is local, not trusted with unbounded bodies.
    app.add_middleware(BodyLimitMiddleware, max_bytes=shared.settings.limits.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=shared.metrics, paths=route_paths(shared.settings, admin=True),
                       access=True)
    return app


def _exit_soon(reason: str) -> None:
    """Lazy mode with model.exit_on_load_failure: the requests that triggered the load get their 503, then
    the process exits non-zero (as background mode does), so a supervisor restarts or reports it."""
    log.critical("exiting: the model failed to load and model.exit_on_load_failure is set: %s", reason)
    asyncio.get_running_loop().call_later(0.5, os._exit, 3)


async def _load_all(models: list[ServedModel]) -> None:
    for served in models:
        await _load(served.manager, served.settings, background=True)


async def _load(manager: ModelManager, settings: Settings, background: bool = False) -> None:
    try:
        await asyncio.to_thread(manager.load_initial)
    except ModelLoadError as exc:
        if settings.model.exit_on_load_failure:
            if background:
                log.critical("exiting: the model failed to load and model.exit_on_load_failure is set")
                os._exit(3)
            raise LoadFailed(3) from exc
