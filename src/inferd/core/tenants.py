"""Tenants: the table of who may call, resolved from a request's key, and the tenant a request runs for.

A tenant (``server.tenants``, ``server.tenants_file``; ``server.api_keys`` are one more, ``default``, without
limits) has keys, stored as SHA-256 digests and compared in constant time against every key, and optional limits
(core/tenant.py holds one tenant's rules, budgets and usage; core/fair_share.py its place in a contended queue).

The HTTP layer resolves the key and sets ``current_tenant`` for the request's task; the route (api/engine_call.py
build, grpc/call.py) reads it as it builds the engine's request, whose ``tenant`` field admission and the long
documents' waves read (None: an open server, or work of the server's own): the engine reads no context variable.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml

from inferd.core.fair_share import FairClock
from inferd.core.tenant import REFUSALS, Tenant
from inferd.settings import Settings, TenantSettings, check_tenant_rules, check_tenants, key_digest

# The tenant ``server.api_keys`` resolve to: no limits, share 1.
DEFAULT_TENANT = "default"

current_tenant: ContextVar[Tenant | None] = ContextVar("inferd_tenant", default=None)


def digest(key: str) -> bytes:
    """A key's SHA-256 (surrogates from odd header bytes must not raise)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Tenancy:
    """The tenant table: keys to tenants, replaced whole on SIGHUP; the per-model fair clocks; usage."""

    def __init__(self, settings: Settings, metrics: Any = None) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self.tenants: dict[str, Tenant] = {}
        self._keys: tuple[tuple[bytes, Tenant], ...] = ()
        self._shares = 1.0
        self.clocks: dict[str, FairClock] = defaultdict(FairClock)
        self.configure(settings)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def configure(self, settings: Settings) -> list[str]:
        """Serve these tenants (at start, and on SIGHUP): a tenant kept keeps its buckets, usage and running
        requests; a tenant gone keeps what it is running (its requests hold it) and its keys stop at once.
        Raises ValueError (a bad tenants file) leaving the table as it was. Returns what changed, for the log."""
        part, names = settings.server.tenant_limits_fraction, settings.model_names()
        # A tenant's models by their own names: admission compares the served name, whichever alias was sent.
        rules = [scaled(r.model_copy(update={"models": tuple(dict.fromkeys(names[m] for m in r.models))}), part)
                 for r in read_tenants(settings)]
        now = time.monotonic()
        old = self.tenants
        fresh: dict[str, Tenant] = {}
        for r in rules:
            tenant = old.get(r.name)
            if tenant is None:
                tenant = Tenant(r, self, now)
            else:
                tenant.apply(r, now)
            fresh[r.name] = tenant
        keys = tuple((key_digest(k), fresh[r.name]) for r in rules for k in r.keys)
        with self._lock:
            self.tenants, self._keys = fresh, keys
            self._shares = sum(r.share for r in rules) or 1.0
        if self.metrics is not None:
            for name in fresh:
                for reason in REFUSALS:
                    self.metrics.tenant_rejected.labels(name, reason)
        changes = [f"{n} added" for n in fresh if n not in old] + [f"{n} removed" for n in old if n not in fresh]
        return changes

    def resolve(self, token: str | None) -> Tenant | None:
        """The tenant whose key this is, comparing with every key (no early exit, equal-length digests): the time
        taken says nothing about which key, or which prefix, matched."""
        supplied = digest(token or "")
        found: Tenant | None = None
        for key, tenant in self._keys:
            if hmac.compare_digest(supplied, key):
                found = tenant
        return found if token is not None else None

    def fraction(self, tenant: Tenant) -> float:
        return tenant.rules.share / self._shares

    def clock(self, model: str) -> FairClock:
        return self.clocks[model]

    def counted(self, tenant: str, model: str, tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.tenant_requests.labels(tenant, model).inc()
            self.metrics.tenant_tokens.labels(tenant, model).inc(tokens)

    def refused(self, tenant: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.tenant_rejected.labels(tenant, reason).inc()

    def report(self) -> dict[str, Any]:
        """``GET /admin/usage``: every tenant served now, since start (or since it was added)."""
        return {name: t.report() for name, t in self.tenants.items()}


def scaled(rules: TenantSettings, part: float) -> TenantSettings:
    """A tenant's limits as one of a fleet's workers enforces them (``server.tenant_limits_fraction``): its part of
    the rates and the budget, and of the concurrency at least one request."""
    if part >= 1.0:
        return rules
    tpm, mc = rules.tokens_per_minute, rules.max_concurrent
    return rules.model_copy(update={
        "requests_per_second": None if rules.requests_per_second is None else rules.requests_per_second * part,
        "tokens_per_minute": None if tpm is None else max(1, round(tpm * part)),
        "max_concurrent": None if mc is None else max(1, math.floor(mc * part))})


def read_tenants(settings: Settings) -> list[TenantSettings]:
    """``server.tenants``, the tenants file's, and ``server.api_keys`` as the tenant ``default``."""
    server = settings.server
    rules = list(server.tenants)
    if server.tenants_file is not None:
        rules += tenants_from_file(server.tenants_file)
    if server.api_keys:
        rules.append(TenantSettings(name=DEFAULT_TENANT, keys=server.api_keys))
    try:
        check_tenants(tuple(rules))
        check_tenant_rules(tuple(rules), settings)
    except ValueError as exc:
        raise ValueError(f"{exc} (server.tenants, server.tenants_file and server.api_keys, which are the tenant "
                         f"{DEFAULT_TENANT!r})") from None
    return rules


def tenants_from_file(path: Path) -> list[TenantSettings]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"server.tenants_file {str(path)!r} cannot be read: {exc}") from None
    entries = data.get("tenants", []) if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError(f"server.tenants_file {str(path)!r}: expected 'tenants:' and a list")
    try:
        return [TenantSettings.model_validate(e) for e in entries]
    except Exception as exc:  # pydantic's ValidationError names the field
        raise ValueError(f"server.tenants_file {str(path)!r}: {exc}") from None
