"""``server:``: the listener, its keys and tenants, logging, connection limits and the platform's routes."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from inferd.settings.base import Docs, LogFormat, LogLevel, Platform, Section

# A tenant's name: a metric label and a log field, so short and plain.
TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# A key stored as its hash: ``sha256:`` and 64 hex digits (docs/tenants.md says how to make one).
KEY_HASH = re.compile(r"^sha256:[0-9a-fA-F]{64}$")


class TenantSettings(Section):
    """One caller of the service (core/tenants.py): its keys and its optional limits; None = no limit."""

    name: str = Field(pattern=TENANT_NAME)
    # Each a key as sent, or its hash (``sha256:<hex>``) so the configuration need not hold the key itself.
    keys: tuple[str, ...] = Field(min_length=1)
    requests_per_second: float | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)
    max_concurrent: int | None = Field(None, gt=0)
    # The models it may call, by served name (empty: all).
    models: tuple[str, ...] = ()
    # The highest priority it may ask for (above: refused), and what it gets when it asks for none: in the range a
    # request may ask for (core/request.py PRIORITIES), and the default at most what its models allow
    # (batching.max_priority, checked with the models: check_tenant_rules).
    priority_ceiling: int | None = Field(None, ge=-100, le=100)
    default_priority: int = Field(0, ge=-100, le=100)
    # Its weight when the queue is contended (weighted fair queuing across tenants inside a priority).
    share: float = Field(1.0, gt=0.0, le=1000.0)

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for key in v:
            if not key or key != key.strip() or " " in key:
                raise ValueError("a key is one non-empty word (it travels as 'Authorization: Bearer <key>')")
            if key.startswith("sha256:") and not KEY_HASH.match(key):
                raise ValueError("a hashed key is 'sha256:' and 64 hex digits")
        return v

    @model_validator(mode="after")
    def _priorities(self) -> TenantSettings:
        if self.priority_ceiling is not None and self.default_priority > self.priority_ceiling:
            raise ValueError(f"tenant {self.name!r}: default_priority {self.default_priority} is above its "
                             f"priority_ceiling {self.priority_ceiling}")
        return self


def key_digest(key: str) -> bytes:
    """A configured key as the SHA-256 digest a request's key is compared with: ``sha256:<hex>`` (either case) is
    one already, so a key and its hash, or one hash written in two cases, are one key."""
    if key.startswith("sha256:"):
        return bytes.fromhex(key[7:])
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def check_tenants(tenants: tuple[TenantSettings, ...]) -> None:
    """One name per tenant and one tenant per key (a key of two tenants would answer as either), keys compared as
    the digests a request is matched by, not as written."""
    names: set[str] = set()
    owners: dict[bytes, str] = {}
    for tenant in tenants:
        if tenant.name in names:
            raise ValueError(f"tenants: {tenant.name!r} is named twice")
        names.add(tenant.name)
        for key in tenant.keys:
            owner = owners.setdefault(key_digest(key), tenant.name)
            if owner != tenant.name:
                raise ValueError(f"tenants: a key of {tenant.name!r} is another tenant's too ({owner!r}'s; a key and "
                                 "its sha256: hash, in either case, are one key)")


class ServerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_port: int | None = Field(None, ge=0, le=65535)
    # text-embeddings-inference's gRPC API (tei.v1, health, reflection) on its own port; None: off (grpc/server.py).
    grpc_port: int | None = Field(None, ge=0, le=65535)
    admin_key: str | None = None
    api_keys: tuple[str, ...] = ()
    # Callers with their own keys, limits and shares (core/tenants.py); api_keys are one more, without limits.
    tenants: tuple[TenantSettings, ...] = ()
    # A YAML file of more tenants (``tenants: [...]``), read at start and again on SIGHUP.
    tenants_file: Path | None = None
    # The part of each tenant's limits (rates, token budgets, concurrency) this process enforces: 1 alone; `inferd
    # fleet` gives each of its N workers 1/N, so the fleet enforces the configured figures (docs/tenants.md).
    tenant_limits_fraction: float = Field(1.0, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _tenants(self) -> ServerSettings:
        check_tenants(self.tenants)
        return self
    metrics_key: str | None = None
    # /docs, /redoc, /openapi.json: keys = behind api_keys (the admin key on the admin port), so open while none
    # are set; public; off (404). The admin routes are never in the main port's schema (api/docs.py).
    docs: Docs = "keys"
    drain_timeout_s: float = Field(30.0, gt=0)
    log_level: LogLevel = "INFO"
    log_format: LogFormat = "text"
    access_log: bool = True
    log_inputs: bool = False
    # Connection-level limits against slow or oversized clients, enforced by inferd.server.http whether or not
    # nginx is in front (docs/security.md). Header/body timeouts bound a whole head/body, not a gap between reads.
    max_header_bytes: int = Field(16_384, ge=1024)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keepalive_timeout_s: float = Field(5.0, gt=0)
    limit_concurrency: int | None = Field(1024, gt=0)
    # A managed platform's routes beside every other (api/platforms.py; docs/platforms.md): SageMaker's /ping and
    # /invocations, or Vertex AI's predict and health routes (AIP_PREDICT_ROUTE, AIP_HEALTH_ROUTE, read at start by
    # inferd/hosting.py, which also detects the platform and takes its port).
    platform: Platform | None = None
    platform_predict_route: str = Field("/vertex", pattern=r"^/\S*$")
    platform_health_route: str | None = Field(None, pattern=r"^/\S*$")
