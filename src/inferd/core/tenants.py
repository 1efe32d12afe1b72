"""Tenants: who a request is, what it may do, what it has used, and its place in a contended queue.

A tenant (``server.tenants``, ``server.tenants_file``; ``server.api_keys`` are one more, ``default``, without
limits) has keys, stored as SHA-256 digests and compared in constant time against every key, and optional limits:
requests per second and tokens per minute (token buckets: a second's and a minute's worth of burst), concurrent
requests, the models it may call, a priority ceiling and default, and its share of a contended queue.

Token budgets count the tokens the model runs (after truncation): before tokenising, admission reserves an estimate
from the characters (``reserve``: requests tokenising at once see each other's), and as it queues the request it
settles the reservation to the tokenised length (``queue``); the charge is given back if the request is then
refused, dropped or fails; a cache hit is never charged (the model ran nothing; the cache is per tenant,
core/cache.py). A budget may go below zero by one request (the debt model): the next requests are refused until
the bucket has refilled past zero, so one large request is never refused for ever. A reload that changes a limit
keeps the level, debt included.

Fair share (VirtualClock, weighted by share): the batcher ranks a model's items by priority plus waiting time,
one priority level per ageing period (core/scheduler.py ``_rank``). Admission keeps a virtual clock per model: a
tenant's request starts at ``max(now, that tenant's last finish)``, capped at its present backlog's worth ahead,
and finishes ``tokens × seconds-per-token / its fraction of the shares`` later. The item is queued at its priority
lowered by how far ahead of now it starts, in ageing periods: exactly the rank it would have if it had arrived when
its share would let it start. A tenant within its share is ranked as today; a flooder's backlog is ranked behind
the others' fresh work, by how far ahead it is, yet still ages, so it is never starved and the batcher never idles
for it (the queueing time itself is the real one: metrics and the companion wait are unchanged). Seconds per token
is the model's own, measured from its answers (EWMA). With one tenant (the share is the whole device) nothing is
changed. Across models the batcher runs the highest head priority first: a model whose head is a flooder's lowered
item yields to another model's fresh work.

The HTTP layer resolves the key and sets ``current_tenant`` for the request's task; admission reads it, so no
signature between the routes and the engine carries it (None: an open server, or work of the server's own).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inferd.core.errors import EngineError, Kind
from inferd.settings import Settings, TenantSettings, check_tenant_rules, check_tenants, key_digest

# The tenant ``server.api_keys`` resolve to: no limits, share 1.
DEFAULT_TENANT = "default"
# Seconds per token before a model has answered anything (MiniLM on two CPU cores runs ~10k tokens/s); each
# answer then moves the estimate (EWMA) towards what the model measured.
PRIOR_SECONDS_PER_TOKEN = 1e-4
_EWMA = 0.3
# Refusal reasons (the metric's label values, /admin/usage's keys).
REFUSALS = ("requests_per_second", "tokens_per_minute", "max_concurrent", "model_not_allowed",
            "priority_not_allowed")

current_tenant: ContextVar[Tenant | None] = ContextVar("inferd_tenant", default=None)


def digest(key: str) -> bytes:
    """A key's SHA-256 (surrogates from odd header bytes must not raise)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Bucket:
    """A token bucket: ``capacity`` at most, ``rate`` per second back; may go below zero (see the docstring)."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity, self.rate, self.level, self.stamp = capacity, rate, capacity, now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def give_back(self, amount: float, now: float) -> None:
        """A charge (or reservation) returned: the level rises by it, never past ``capacity``."""
        self.level = min(self.capacity, self.refill(now) + amount)

    def wait(self, now: float, need: float = 0.0) -> float:
        """Seconds until the level is above ``need`` (0: it is)."""
        level = self.refill(now)
        return 0.0 if level > need else (need - level) / self.rate + 1e-3

    def reset_in(self, now: float) -> float:
        """Seconds until it is full again."""
        return max(0.0, self.capacity - self.refill(now)) / self.rate


def _carried(old: Bucket | None, new: Bucket, now: float) -> Bucket:
    """``new`` at ``old``'s level now (a fresh bucket starts full)."""
    if old is not None:
        new.level = min(new.capacity, old.refill(now))
    return new


class RateLimited(EngineError):
    """A tenant over a limit: the kind the HTTP layer answers 429 with ``retry_after`` seconds."""

    def __init__(self, message: str, code: str, retry_after: float) -> None:
        super().__init__(Kind.RATE_LIMITED, message, code)
        self.retry_after = retry_after


@dataclass
class Usage:
    """Since start, per model: answered requests and the tokens the model ran for them."""

    requests: int = 0
    tokens: int = 0


class Tenant:
    """One tenant's live state: its rules (replaced on SIGHUP), buckets, concurrency and usage."""

    def __init__(self, rules: TenantSettings, table: Tenancy, now: float) -> None:
        """``rules`` as this process enforces them (``Tenancy`` scales a fleet worker's part)."""
        self.name = rules.name
        self.table = table
        self.in_flight = 0
        self.usage: dict[str, Usage] = defaultdict(Usage)
        self.refusals: dict[str, int] = defaultdict(int)
        self.rules = rules
        self.requests: Bucket | None = None
        self.tokens: Bucket | None = None
        self.apply(rules, now)

    def apply(self, rules: TenantSettings, now: float) -> None:
        """New rules; a bucket keeps its level, debt included, whatever its new limit (at most the new capacity):
        a SIGHUP is no free refill, and a tenant in debt stays refused until the debt is paid at the new rate."""
        old = self.rules
        self.rules = rules
        rps, tpm = rules.requests_per_second, rules.tokens_per_minute
        if rps is None:
            self.requests = None
        elif self.requests is None or old.requests_per_second != rps:
            self.requests = _carried(self.requests, Bucket(max(1.0, rps), rps, now), now)
        if tpm is None:
            self.tokens = None
        elif self.tokens is None or old.tokens_per_minute != tpm:
            self.tokens = _carried(self.tokens, Bucket(float(tpm), tpm / 60.0, now), now)

    # -- admission (on the event loop) ---------------------------------------------------------------------

    def admit(self, model: str, priority: int) -> int:
        """The checks before any work: the model, the priority (the tenant's default for 0), concurrency and the
        request rate. Returns the priority to run at; the caller must ``leave()`` once answered."""
        rules = self.rules
        if rules.models and model not in rules.models:
            self._refuse("model_not_allowed", model)
            raise EngineError(Kind.MODEL_NOT_FOUND, f"model {model!r} is not available to this API key",
                              "model_not_allowed", field="model")
        if priority == 0:
            priority = rules.default_priority
        if rules.priority_ceiling is not None and priority > rules.priority_ceiling:
            self._refuse("priority_not_allowed", model)
            raise EngineError(Kind.INVALID_INPUT, f"priority {priority} is above this API key's ceiling, "
                              f"{rules.priority_ceiling}", "priority_not_allowed", field="priority")
        now = time.monotonic()
        if rules.max_concurrent is not None and self.in_flight >= rules.max_concurrent:
            self._refuse("max_concurrent", model)
            raise RateLimited(f"this API key has {rules.max_concurrent} requests running, its limit "
                              "(max_concurrent); retry when one is answered", "rate_limit_exceeded", 1.0)
        if self.tokens is not None and (wait := self.tokens.wait(now)) > 0:
            raise self._spent(model, wait)
        if self.requests is not None:
            wait = self.requests.wait(now, 1.0 - 1e-9)
            if wait > 0:
                self._refuse("requests_per_second", model)
                raise RateLimited(f"this API key sent more than {rules.requests_per_second:g} requests per "
                                  f"second; retry in {wait:.2f} s", "rate_limit_exceeded", wait)
            self.requests.level -= 1.0
        self.in_flight += 1
        return priority

    def leave(self) -> None:
        self.in_flight -= 1

    def reserve(self, tokens: int) -> int:
        """Before tokenising (after ``admit``): an estimate of the request's tokens taken from the budget at once, so
        that requests tokenising at the same time see each other's and the budget's check at admission holds for
        them all. ``queue`` settles it against the real count, or ``release`` gives it back; returns what was taken
        (0 without a token budget), to pass to either, exactly once."""
        if self.tokens is None:
            return 0
        self.tokens.refill(time.monotonic())
        self.tokens.level -= tokens
        return tokens

    def release(self, reserved: int) -> None:
        """A reservation given back whole: the request was refused, failed or left before it was queued."""
        if self.tokens is not None and reserved:
            self.tokens.give_back(reserved, time.monotonic())

    def queue(self, model: str, tokens: int, now: float, priority: int, ageing_s: float, reserved: int = 0) -> float:
        """Work of ``tokens`` about to be queued for ``model`` at ``priority``, ``reserved`` of them taken already:
        charged, and the priority to queue it at, lowered by how far ahead of its share the tenant is (in ageing
        periods: the batcher's exchange rate between waiting and priority). ``done`` must follow, exactly once.

        The debt model: a count within its reservation is charged (the budget was above zero when it was reserved);
        a count beyond it only if the budget, without this request, is still above zero, else the request is
        refused here, as admission would have (the reservation is settled either way). So the budget goes below
        zero by at most one request, however many tokenise at once and whatever the estimate was."""
        if self.tokens is not None:
            self.tokens.give_back(reserved, now)
            if tokens > reserved and (wait := self.tokens.wait(now)) > 0:
                raise self._spent(model, wait)
            self.tokens.level -= tokens
        fraction = self.table.fraction(self)
        lead = self.table.clock(model).enqueue(self.name, fraction, tokens, now)
        # The only tenant has the whole device: its ranking stays exactly as it was without tenants.
        return priority if fraction >= 1.0 else priority - lead / ageing_s

    def done(self, model: str, tokens: int, ran: bool, infer_s: float = 0.0, batch_items: int = 0,
             items: int = 0) -> None:
        """The queued work left the queue: answered (``ran``: counted), or refused, dropped or failed (its charge
        given back)."""
        self.table.clock(model).answered(self.name, tokens, infer_s if ran else 0.0, batch_items, items)
        self.settle(model, tokens, ran)

    def settle(self, model: str, tokens: int, ran: bool) -> None:
        if ran:
            use = self.usage[model]
            use.requests += 1
            use.tokens += tokens
            self.table.counted(self.name, model, tokens)
        elif self.tokens is not None:
            self.tokens.give_back(tokens, time.monotonic())

    def _spent(self, model: str, wait: float) -> RateLimited:
        self._refuse("tokens_per_minute", model)
        return RateLimited(f"this API key used its {self.rules.tokens_per_minute} tokens per minute; retry in "
                           f"{wait:.2f} s", "rate_limit_exceeded", wait)

    def _refuse(self, reason: str, model: str) -> None:
        self.refusals[reason] += 1
        self.table.refused(self.name, reason)

    # -- what a client reads -----------------------------------------------------------------------------

    def headers(self, now: float, retry_after: float | None = None) -> dict[str, str]:
        """OpenAI's rate-limit headers (and Retry-After on a refusal) for this tenant's limits."""
        out: dict[str, str] = {}
        if self.requests is not None:
            out["x-ratelimit-limit-requests"] = f"{self.rules.requests_per_second:g}/s"
            out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self.requests.refill(now))))
            out["x-ratelimit-reset-requests"] = duration(self.requests.reset_in(now))
        if self.tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.rules.tokens_per_minute)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(self.tokens.refill(now))))
            out["x-ratelimit-reset-tokens"] = duration(self.tokens.reset_in(now))
        if retry_after is not None:
            # Retry-After is whole seconds (RFC 9110); OpenAI's SDK reads retry-after-ms first, to the ms.
            out["Retry-After"] = str(max(1, math.ceil(retry_after)))
            out["retry-after-ms"] = str(max(1, math.ceil(retry_after * 1000)))
        return out

    def report(self) -> dict[str, Any]:
        return {"models": {m: {"requests": u.requests, "tokens": u.tokens} for m, u in sorted(self.usage.items())},
                "refused": dict(sorted(self.refusals.items())), "in_flight": self.in_flight}


def duration(seconds: float) -> str:
    """As OpenAI writes its reset headers: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


@dataclass
class FairClock:
    """One model's virtual clock across tenants (see the module's docstring)."""

    seconds_per_token: float = PRIOR_SECONDS_PER_TOKEN
    finish: dict[str, float] = field(default_factory=dict)
    backlog: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # tokens queued, not answered

    def enqueue(self, tenant: str, fraction: float, tokens: int, now: float) -> float:
        """How far ahead of its share (seconds) a request of ``tokens`` from ``tenant`` starts, at ``now``."""
        pace = self.seconds_per_token / fraction
        # No credit for time idle, and no debt for device time taken while nobody else wanted it: a tenant is at
        # most its present backlog's worth ahead (a flood that ended long ago is not held against it).
        start = max(now, min(self.finish.get(tenant, now), now + self.backlog[tenant] * pace))
        self.finish[tenant] = start + tokens * pace
        self.backlog[tenant] += tokens
        return start - now

    def answered(self, tenant: str, tokens: int, infer_s: float, batch_items: int, items: int) -> None:
        """A request left the queue; its timings, when it ran, move the seconds-per-token estimate."""
        self.backlog[tenant] -= tokens
        if infer_s > 0 and tokens > 0 and items > 0:
            # Its batch ran about batch_items items of this request's mean length.
            sample = infer_s / (max(batch_items, items) * tokens / items)
            self.seconds_per_token += _EWMA * (sample - self.seconds_per_token)


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
