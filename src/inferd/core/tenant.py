"""One tenant: what it may do, what it has used, and the checks and charges admission makes for its requests.

A tenant's limits are optional: requests per second and tokens per minute (token buckets: a second's and a
minute's worth of burst, core/token_bucket.py), concurrent requests, the models it may call, a priority ceiling and
default, and its share of a contended queue (core/fair_share.py).

Token budgets count the tokens the model runs (after truncation): before tokenising, admission reserves an estimate
from the characters (``reserve``: requests tokenising at once see each other's), and as it queues the request it
settles the reservation to the tokenised length (``queue``); the charge is given back if the request is then
refused, dropped or fails; a cache hit is never charged (the model ran nothing; the cache is per tenant,
core/cache.py). A budget may go below zero by one request (the debt model): the next requests are refused until
the bucket has refilled past zero, so one large request is never refused for ever. A reload that changes a limit
keeps the level, debt included.

A batch job's lines (jobs/lines.py, with ``job_line`` set) are charged to the budget as any request, but are not the
tenant's requests in flight or per second: a job of 128 lines in flight would otherwise take its owner's
``max_concurrent`` and rate from the owner's own online traffic, which goes first.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferd.core.errors import EngineError, Kind
from inferd.core.token_bucket import Bucket, carried
from inferd.settings import TenantSettings

if TYPE_CHECKING:
    from inferd.core.tenants import Tenancy

# Refusal reasons (the metric's label values, /admin/usage's keys).
REFUSALS = ("requests_per_second", "tokens_per_minute", "max_concurrent", "model_not_allowed",
            "priority_not_allowed")


# Set by the batch runner for a job line's own task (jobs/lines.py): admission's request limits pass it.
job_line: ContextVar[bool] = ContextVar("inferd_job_line", default=False)


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
            self.requests = carried(self.requests, Bucket(max(1.0, rps), rps, now), now)
        if tpm is None:
            self.tokens = None
        elif self.tokens is None or old.tokens_per_minute != tpm:
            self.tokens = carried(self.tokens, Bucket(float(tpm), tpm / 60.0, now), now)

    # -- admission (on the event loop) ---------------------------------------------------------------------

    def admit(self, model: str, priority: int) -> int:
        """The checks before any work: the model, the priority (the tenant's default for 0), concurrency and the
        request rate. Returns the priority to run at; the caller must ``leave()`` once answered."""
        rules = self.rules
        self.allow(model)
        if priority == 0:
            priority = rules.default_priority
        if rules.priority_ceiling is not None and priority > rules.priority_ceiling:
            self._refuse("priority_not_allowed", model)
            raise EngineError(Kind.INVALID_INPUT, f"priority {priority} is above this API key's ceiling, "
                              f"{rules.priority_ceiling}", "priority_not_allowed", field="priority")
        now = time.monotonic()
        job = job_line.get()  # a batch job's line: its token budget only
        if not job and rules.max_concurrent is not None and self.in_flight >= rules.max_concurrent:
            self._refuse("max_concurrent", model)
            raise RateLimited(f"this API key has {rules.max_concurrent} requests running, its limit "
                              "(max_concurrent); retry when one is answered", "rate_limit_exceeded", 1.0)
        if self.tokens is not None and (wait := self.tokens.wait(now)) > 0:
            raise self._spent(model, wait)
        if job:
            return priority
        if self.requests is not None:
            wait = self.requests.wait(now, 1.0 - 1e-9)
            if wait > 0:
                self._refuse("requests_per_second", model)
                raise RateLimited(f"this API key sent more than {rules.requests_per_second:g} requests per "
                                  f"second; retry in {wait:.2f} s", "rate_limit_exceeded", wait)
            self.requests.level -= 1.0
        self.in_flight += 1
        return priority

    def allow(self, model: str) -> None:
        """Refuses a model its ``models`` leave out. ``admit`` checks it, and admission (core/admission.py, and
        core/pieces.py for a document's pieces) checks it first, before the model is loaded (lazy mode) or any text
        is split for it: a tenant may not make the server load, or work with, a model it may not call."""
        rules = self.rules
        if rules.models and model not in rules.models:
            self._refuse("model_not_allowed", model)
            raise EngineError(Kind.MODEL_NOT_FOUND, f"model {model!r} is not available to this API key",
                              "model_not_allowed", field="model")

    def leave(self) -> None:
        if not job_line.get():  # admitted in the same task, so the same context: a job line was not counted
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
