"""The API's own documentation (``/openapi.json``, ``/docs``, ``/redoc``), as ``server.docs`` says: public,
behind the keys (the inference keys on the main port, the admin key on the admin port), or off (404).

FastAPI's built-in documentation routes take no dependencies, so they were public whatever the keys, and their
schema listed every ``/admin/*`` route where admin shares the main port. The main port's schema never lists
the admin routes: a caller holding an inference key, or none, learns nothing of them from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from starlette.responses import HTMLResponse, JSONResponse

from inferd import __version__
from inferd.api.errors import APIError
from inferd.api.security import require_admin, require_tenant_key
from inferd.api.services import services

SCHEMA = "/openapi.json"


def docs_router(title: str, routers: Sequence[APIRouter], admin: bool = False) -> APIRouter:
    """The documentation routes of an app, describing ``routers`` (the main app's: never the admin router;
    ``admin``: the admin app's, keyed by the admin key)."""
    router = APIRouter(include_in_schema=False)
    built: list[dict[str, Any]] = []  # the routes are fixed once the app serves: one schema per app

    def allow(request: Request) -> None:
        s = services(request)
        mode = s.settings.server.docs
        if mode == "off":
            raise APIError(404, "not found", "not_found")
        if mode == "keys":
            if admin:
                require_admin(request, s.settings.server.admin_key, s.metrics)
            else:
                require_tenant_key(request, s.tenancy, "the API documentation", s.metrics)

    def schema_url(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/") + SCHEMA

    @router.get(SCHEMA)
    async def openapi(request: Request) -> JSONResponse:
        allow(request)
        if not built:
            routes = [route for included in routers for route in included.routes]
            built.append(get_openapi(title=title, version=__version__, routes=routes))
        return JSONResponse(built[0])

    @router.get("/docs")
    async def swagger(request: Request) -> HTMLResponse:
        allow(request)
        return get_swagger_ui_html(openapi_url=schema_url(request), title=f"{title} - Swagger UI")

    @router.get("/redoc")
    async def redoc(request: Request) -> HTMLResponse:
        allow(request)
        return get_redoc_html(openapi_url=schema_url(request), title=f"{title} - ReDoc")

    return router
