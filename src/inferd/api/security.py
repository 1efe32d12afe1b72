"""Bearer-key checks, in constant time. Health stays public; the rest is as configured."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.requests import Request

from inferd.api.errors import APIError


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(token: str | None, keys: Iterable[str]) -> bool:
    ok = False
    supplied = (token or "").encode()
    for key in keys:
        # Compare with every key (no early exit), so timing does not reveal which key or prefix matched.
        ok |= hmac.compare_digest(supplied, key.encode())
    return ok and token is not None


def _unauthorized(what: str) -> APIError:
    return APIError(401, f"a valid API key is required for {what}: send 'Authorization: Bearer <key>'",
                    "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_keys(request: Request, keys: tuple[str, ...], what: str) -> None:
    if keys and not _matches(_bearer(request), keys):
        raise _unauthorized(what)


def require_admin(request: Request, admin_key: str | None) -> None:
    if not admin_key:
        # No key configured: the admin surface does not exist.
        raise APIError(404, "not found", "not_found")
    if not _matches(_bearer(request), (admin_key,)):
        raise _unauthorized("admin routes")
