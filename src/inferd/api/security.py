"""Bearer-key checks, in constant time. Health stays public; the rest is as configured.

Missing, malformed and wrong keys get the same 401 (body and ``WWW-Authenticate: Bearer``), so a caller
learns nothing about which keys exist.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request

from inferd.api.errors import APIError
from inferd.api.middleware import EXTRA_HEADERS, context
from inferd.core.tenant import Tenant
from inferd.core.tenants import Tenancy, current_tenant


def bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when the header is absent or malformed. Two
    Authorization headers are refused (400), as two Host headers are (server/http.py): the field is a singleton,
    and whichever one a server reads, a proxy in front may have checked the other."""
    sent = request.headers.getlist("authorization")
    if len(sent) > 1:
        raise APIError(400, f"the request has {len(sent)} Authorization headers; at most one is allowed",
                       "invalid_authorization")
    header = sent[0] if sent else ""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def _digest(value: str) -> bytes:
    # Hashing first gives equal-length inputs to compare_digest, so the time spent does not reveal a key's
    # length either; surrogates (odd header bytes) must not raise.
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def key_matches(token: str | None, keys: Iterable[str]) -> bool:
    supplied = _digest(token or "")
    ok = False
    for key in keys:
        # Compare with every key (no early exit), so timing does not reveal which key or prefix matched.
        ok |= hmac.compare_digest(supplied, _digest(key))
    return ok and token is not None


def _unauthorized(what: str, metrics: Any) -> APIError:
    if metrics is not None:
        metrics.rejected.labels("unauthorized").inc()
    return APIError(401, f"a valid API key is required for {what}: send 'Authorization: Bearer <key>'",
                    "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_tenant(request: Request, tenancy: Tenancy, metrics: Any = None) -> None:
    """The inference routes' key check, by tenant (core/tenants.py): open when no key of any tenant is configured;
    otherwise the Bearer key's tenant, set for the request (admission reads it, the access log shows its name,
    the response carries its rate-limit headers). Nothing else the client sends names a tenant."""
    tenant = require_tenant_key(request, tenancy, "inference", metrics)
    if tenant is None:
        return
    current_tenant.set(tenant)
    context(request.scope)["tenant"] = tenant.name
    request.scope[EXTRA_HEADERS] = tenant.headers


def require_tenant_key(request: Request, tenancy: Tenancy, what: str, metrics: Any = None) -> Tenant | None:
    """Any tenant's key (``server.api_keys`` included) when one is configured: the tenant; None: the server is open."""
    if not tenancy.enabled:
        return None
    tenant = tenancy.resolve(bearer_token(request))
    if tenant is None:
        raise _unauthorized(what, metrics)
    return tenant


def require_keys(request: Request, keys: tuple[str, ...], what: str, metrics: Any = None) -> None:
    """Open when no keys are configured; otherwise one of them, as a Bearer token (refusals counted)."""
    if keys and not key_matches(bearer_token(request), keys):
        raise _unauthorized(what, metrics)


def require_admin(request: Request, admin_key: str | None, metrics: Any = None) -> None:
    if not admin_key:
        # No key configured: the admin surface does not exist (404, as for any unknown path).
        raise APIError(404, "not found", "not_found")
    if not key_matches(bearer_token(request), (admin_key,)):
        raise _unauthorized("admin routes", metrics)
