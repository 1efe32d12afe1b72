"""Fair share across a contended queue: one virtual clock per model, weighted by each tenant's share.

The batcher ranks a model's items by priority plus waiting time, one priority level per ageing period
(core/scheduler.py ``_rank``). Admission keeps a virtual clock per model: a tenant's request starts at
``max(now, that tenant's last finish)``, capped at its present backlog's worth ahead, and finishes
``tokens × seconds-per-token / its fraction of the shares`` later. The item is queued at its priority lowered by how
far ahead of now it starts, in ageing periods: exactly the rank it would have if it had arrived when its share would
let it start. A tenant within its share is ranked as today; a flooder's backlog is ranked behind the others' fresh
work, by how far ahead it is, yet still ages, so it is never starved and the batcher never idles for it (the
queueing time itself is the real one: metrics and the companion wait are unchanged). Seconds per token is the
model's own, measured from its answers (EWMA). With one tenant (the share is the whole device) nothing is changed.
Across models the batcher runs the highest head priority first: a model whose head is a flooder's lowered item
yields to another model's fresh work.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

# Seconds per token before a model has answered anything (MiniLM on two CPU cores runs ~10k tokens/s); each
# answer then moves the estimate (EWMA) towards what the model measured.
PRIOR_SECONDS_PER_TOKEN = 1e-4
_EWMA = 0.3


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
