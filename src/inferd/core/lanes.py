"""The lanes: one model's pending work, and the choice of which lane's ready batch runs next.

A ``Lane`` is one model's queue state (its items, its policy and bound, its share of the device and the fairness
clock); ``choose_lane`` picks among the lanes that have a batch ready. Pure data and a pure function: the lock, the
waking and the hand-out are the queue's (core/batcher.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inferd.core.scheduler import Policy

# The adaptive wait's estimate of the gap between requests: the weight of the newest gap, and its cap.
ARRIVAL_EWMA = 0.2
ARRIVAL_GAP_CAP_S = 1.0


@dataclass(frozen=True, slots=True)
class ReadyBatch:
    """A lane's ready batch, as the choice between lanes sees it."""

    priority: int  # the batch head's own priority (ageing ranks items within a lane, not lanes)
    served: float  # the lane's device time so far, divided by its share (start-time fair queueing)
    deadline: float  # the earliest deadline in the batch


def choose_lane(ready: Sequence[ReadyBatch]) -> int:
    """Which lane's batch runs next: the highest priority first, then the lane that has had the least device
    time for its share (so a flooded model cannot starve another), then the nearest deadline, then the order
    the lanes were configured in."""
    return min(range(len(ready)), key=lambda i: (-ready[i].priority, ready[i].served, ready[i].deadline, i))


@dataclass(eq=False)
class Lane:
    """One model's queue: its pending items, its batching policy and bound, and its share of the device."""

    name: str
    policy: Policy
    max_queue: int
    share: float = 1.0
    pending: list[Any] = field(default_factory=list)
    # Mean seconds between put() calls (one per request), exponentially weighted; None before two.
    arrival_gap: float | None = None
    last_put: float | None = None
    # When it last took a request above background priority (None: never): while recent, background batches stay
    # small (core/scheduler.py Policy.background_max_batch_size).
    last_live: float | None = None
    # Device seconds this lane's batches took, divided by its share: the fair-queueing clock.
    served: float = 0.0
    retiring: bool = False  # its model is gone: it takes no new work and goes once empty
    # A shadow lane (core/shadow.py): its batches run only while no live lane holds work, never counted.
    shadow: bool = False

    def note_arrival(self, now: float) -> None:
        if self.last_put is not None:
            # One long pause must not keep the wait off through the burst after it: a gap counts 1 s at most.
            gap = min(now - self.last_put, ARRIVAL_GAP_CAP_S)
            self.arrival_gap = gap if self.arrival_gap is None else (
                ARRIVAL_EWMA * gap + (1 - ARRIVAL_EWMA) * self.arrival_gap)
        self.last_put = now
