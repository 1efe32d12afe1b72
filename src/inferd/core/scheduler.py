"""The scheduling policy: which pending items of one lane run together, as a pure function.

``next_batch`` reads only the pending items, the time and the policy: it decides which items run together, which
have passed their deadline and which belong to requests that are gone. It knows nothing of HTTP, torch or threads:
an item is opaque work with a token cost, a priority, a deadline and the model slot it must run on (``Slot``, what
the scheduler needs of one). A slot whose capabilities say it does not pad (a backend that computes real tokens only)
gets no padding floor: padding costs it nothing. The queue around it is core/batcher.py; the choice between lanes is
core/lanes.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from inferd.core.capabilities import Capabilities


@dataclass(frozen=True)
class Policy:
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_wait_ms: float = 2.0
    sort_window: int = 128
    ageing_ms: float = 1000.0
    # Real tokens / padded tokens a batch must keep: an item that would pad the batch below this waits for
    # a batch of its own length. 0 = fill by count and token budget alone.
    min_padding_efficiency: float = 0.0
    # Wait (max_wait_ms) only for a companion the recent arrivals say is due within the wait: a lone request
    # at low load runs at once instead of paying the whole wait for company that is not coming.
    adaptive_wait: bool = True
    # Background batches (batch jobs' lines): a live request that comes while one runs waits for it, so their padded
    # tokens are bounded: by ``background_live_batch_tokens`` while live requests came within ``background_quiet_s``,
    # else by ``background_max_batch_tokens`` (a job alone keeps big batches; the first live request after a quiet
    # spell waits for one of those at most).
    background_max_batch_tokens: int = 8192
    background_live_batch_tokens: int = 8192
    background_quiet_s: float = 1.0

    @classmethod
    def from_settings(cls, s: Any) -> Policy:
        return cls(s.max_batch_size, s.max_batch_tokens, s.max_wait_ms, s.sort_window, s.ageing_ms,
                   s.min_padding_efficiency, s.adaptive_wait, s.background_max_batch_tokens,
                   s.background_live_batch_tokens, s.background_quiet_s)


class Slot(Protocol):
    """What the scheduler needs of the model slot an item must run on (core/slots.py ModelSlot): items batch only
    with items of the same slot (by identity), and its forward pass's capabilities decide the padding floor."""

    @property
    def capabilities(self) -> Capabilities: ...


class Schedulable(Protocol):
    tokens: int
    priority: int
    enqueued: float
    deadline: float
    seq: int

    @property
    def slot(self) -> Slot: ...

    @property
    def gone(self) -> bool: ...


# The items a decision is of (the engine's WorkItem): the scheduler reads only what Schedulable says; the worker gets
# its own items back, typed, each with the slot it must run on.
Item = TypeVar("Item", bound=Schedulable)


@dataclass
class Decision(Generic[Item]):
    batch: list[Item] = field(default_factory=list)
    expired: list[Item] = field(default_factory=list)
    dropped: list[Item] = field(default_factory=list)
    # Seconds until the decision could change without new input; None = only new input changes it.
    wait: float | None = None

    @property
    def empty(self) -> bool:
        return not (self.batch or self.expired or self.dropped)


# Background work: the lowest priority a request may ask (core/request.py PRIORITIES; batch jobs' lines run at it,
# jobs/lines.py). It never rides in a batch led by anything above it: filled with background items, a live
# request's batch would wait for (and run as) a full batch of them. It leads batches of its own, filled as usual.
BACKGROUND = -100


def _rides_with(item: Schedulable, head: Schedulable) -> bool:
    return item.priority > BACKGROUND or head.priority <= BACKGROUND


def _rank(item: Schedulable, now: float, policy: Policy) -> tuple[float, int]:
    # Higher priority first; waiting raises priority (ageing) so low priority still completes; FIFO within.
    aged = item.priority + (now - item.enqueued) * 1000.0 / policy.ageing_ms
    return (-aged, item.seq)


def is_background(item: Schedulable) -> bool:
    return item.priority <= BACKGROUND


def next_batch(pending: Sequence[Item], now: float, policy: Policy,
               arrival_gap: float | None = None, last_live: float | None = None) -> Decision[Item]:
    """``arrival_gap``: the recent mean seconds between requests (None: not known), for the adaptive wait;
    ``last_live``: when the lane last took a request above background (None: never), for background batches."""
    decision: Decision[Item] = Decision()
    live: list[Item] = []
    for item in pending:
        if item.gone:
            decision.dropped.append(item)
        elif item.deadline <= now:
            decision.expired.append(item)
        else:
            live.append(item)
    if not live:
        return decision
    live.sort(key=lambda it: _rank(it, now, policy))
    head = live[0]
    max_tokens = policy.max_batch_tokens
    if is_background(head):
        # A runner that runs a job's batch on every thread of the model keeps live batches on their own instances
        # beside it (core/worker.py ``_background_wide``): no live request waits for that batch, so it keeps the
        # bound of a job alone.
        live_recent = (last_live is not None and now - last_live < policy.background_quiet_s
                       and not head.slot.capabilities.can_use_all_threads)
        max_tokens = min(max_tokens, policy.background_live_batch_tokens if live_recent
                         else policy.background_max_batch_tokens)
    if head.tokens >= max_tokens:
        # Over budget on its own: it runs alone rather than hold back (or be held back by) others.
        decision.batch = [head]
        return decision
    same_slot = [it for it in live[1:]
                 if it.slot is head.slot and it.tokens < policy.max_batch_tokens and _rides_with(it, head)]
    window = same_slot[: policy.sort_window - 1]
    # Length-aware grouping: nearest lengths to the head first; the head itself is the oldest/highest
    # priority item, so long texts cannot starve.
    window.sort(key=lambda it: abs(it.tokens - head.tokens))
    batch = [head]
    longest = real = head.tokens
    floor = policy.min_padding_efficiency if head.slot.capabilities.pads else 0.0
    for item in window:
        if len(batch) >= policy.max_batch_size:
            break
        widest = max(longest, item.tokens)
        padded = widest * (len(batch) + 1)
        if padded > max_tokens or real + item.tokens < floor * padded:
            continue
        batch.append(item)
        longest = widest
        real += item.tokens
    could_grow = len(batch) < policy.max_batch_size and len(batch) == len(same_slot) + 1
    if could_grow and policy.max_wait_ms > 0:
        # Everything compatible fits: wait for companions, but never past the oldest item's max wait, and
        # (adaptive) not at all when the next request is not due before that: at one request per 20 ms, a 2 ms
        # wait would add 2 ms to every request, with nothing to batch it with.
        ready_at = min(it.enqueued for it in batch) + policy.max_wait_ms / 1000.0
        expected = (max(it.enqueued for it in live) + arrival_gap
                    if policy.adaptive_wait and arrival_gap is not None else now)
        if ready_at > now and expected < ready_at:
            decision.wait = min(ready_at, min(it.deadline for it in live)) - now
            return decision
    decision.batch = batch
    return decision
