"""The services a request may use, as one typed object, and the router dependencies that check its keys.

create_app builds the object once and stores it on the app; routes read it through ``services(request)``
(typed, so a misspelt name is an error, not an AttributeError at run time). The admin app shares the
main app's state, so both read the same object.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from tokenizers import Tokenizer

from inferd.api.security import require_admin, require_tenant
from inferd.core.engine import InferenceEngine
from inferd.core.memory import MemoryGuard
from inferd.core.registry import ModelRegistry
from inferd.core.tenants import Tenancy
from inferd.settings import Settings
from inferd.utils.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    engine: InferenceEngine
    metrics: Metrics
    memory_guard: MemoryGuard  # or a stand-in with its methods (tests)
    started_at: float
    tenancy: Tenancy  # who may call, with what limits; replaced in place on SIGHUP
    # TEI's /tokenize and /decode show every token: an untruncated copy of a load's tokenizer, by load id, the
    # last few loads' (api/tei_tokens.py keeps it; a copy per request would cost more than the tokenising).
    tokenizers: OrderedDict[int, Tokenizer] = field(default_factory=OrderedDict)

    @property
    def registry(self) -> ModelRegistry:
        """Every served model, by name."""
        return self.engine.registry


def services_of(app: Any) -> Services:
    """The one place the app's state is read."""
    found = app.state.services
    assert isinstance(found, Services)
    return found


def services(request: Request) -> Services:
    return services_of(request.app)


# -- router dependencies: a router's routes all need the same key, so the router checks it -------------------
# async def, though nothing in them awaits: FastAPI runs a plain def dependency in its thread pool, and that hop
# (a thread woken, the GIL handed over and back, a loop wake-up) cost every request more CPU than the check itself.

async def inference_auth(request: Request) -> None:
    """The inference routes (and what is served, /v1/models, /info): a tenant's key (``server.api_keys`` are the
    tenant ``default``'s), if any is configured."""
    s = services(request)
    require_tenant(request, s.tenancy, s.metrics)


async def admin_auth(request: Request) -> None:
    """The admin routes: ``server.admin_key``; without one configured they do not exist (404)."""
    s = services(request)
    require_admin(request, s.settings.server.admin_key, s.metrics)
