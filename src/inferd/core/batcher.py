"""The batch queue and its scheduling policy.

``next_batch`` is a pure function of the pending items, the time and the policy: it decides which items
run together, which have passed their deadline and which belong to requests that are gone. The queue
only holds items and wakes the worker. Neither knows about HTTP or torch: an item is opaque work with a
token cost, a priority, a deadline and a group (the model slot it must run on: ``Group``, what the scheduler needs
of it). A group whose capabilities say it does not pad (a backend that computes real tokens only) gets no padding
floor: padding costs it nothing.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
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

    @classmethod
    def from_settings(cls, s: Any) -> Policy:
        return cls(s.max_batch_size, s.max_batch_tokens, s.max_wait_ms, s.sort_window, s.ageing_ms,
                   s.min_padding_efficiency, s.adaptive_wait)


class Group(Protocol):
    """What the scheduler needs of the model slot an item must run on (core/slots.py ModelSlot): items batch only
    with their own group's (by identity), and its forward pass's capabilities decide the padding floor."""

    @property
    def capabilities(self) -> Capabilities: ...


class Schedulable(Protocol):
    tokens: int
    priority: int
    enqueued: float
    deadline: float
    seq: int

    @property
    def group(self) -> Group: ...

    @property
    def gone(self) -> bool: ...


# The items a decision is of (the engine's WorkItem): the scheduler reads only what Schedulable says; the worker gets
# its own items back, typed, their group the slot it must run on.
Item = TypeVar("Item", bound=Schedulable)


@dataclass
class Decision(Generic[Item]):
    batch: list[Item] = field(default_factory=list)
    expired: list[Item] = field(default_factory=list)
    dropped: list[Item] = field(default_factory=list)
    # Seconds until the decision could change without new input; None = only new input changes it.
    wait: float | None = None
    # Not the scheduler's: callables the queue hands to the worker with the decision (BatchQueue.post).
    chores: list[Any] = field(default_factory=list)
    # The queue's: the lane (model) the batch is of.
    lane: str = ""

    @property
    def empty(self) -> bool:
        return not (self.batch or self.expired or self.dropped)


def _rank(item: Schedulable, now: float, policy: Policy) -> tuple[float, int]:
    # Higher priority first; waiting raises priority (ageing) so low priority still completes; FIFO within.
    aged = item.priority + (now - item.enqueued) * 1000.0 / policy.ageing_ms
    return (-aged, item.seq)


def next_batch(pending: Sequence[Item], now: float, policy: Policy,
               arrival_gap: float | None = None) -> Decision[Item]:
    """``arrival_gap``: the recent mean seconds between requests (None: not known), for the adaptive wait."""
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
    if head.tokens >= policy.max_batch_tokens:
        # Over budget on its own: it runs alone rather than hold back (or be held back by) others.
        decision.batch = [head]
        return decision
    same_group = [it for it in live[1:] if it.group is head.group and it.tokens < policy.max_batch_tokens]
    window = same_group[: policy.sort_window - 1]
    # Length-aware grouping: nearest lengths to the head first; the head itself is the oldest/highest
    # priority item, so long texts cannot starve.
    window.sort(key=lambda it: abs(it.tokens - head.tokens))
    batch = [head]
    longest = real = head.tokens
    floor = policy.min_padding_efficiency if head.group.capabilities.pads else 0.0
    for item in window:
        if len(batch) >= policy.max_batch_size:
            break
        widest = max(longest, item.tokens)
        padded = widest * (len(batch) + 1)
        if padded > policy.max_batch_tokens or real + item.tokens < floor * padded:
            continue
        batch.append(item)
        longest = widest
        real += item.tokens
    could_grow = len(batch) < policy.max_batch_size and len(batch) == len(same_group) + 1
    if could_grow and policy.max_wait_ms > 0:
        # Everything compatible fits: wait for companions, but never past the oldest item's max wait, and
        # (adaptive) not at all when the next request is not due before that: at one request per 20 ms the
        # 2 ms wait was 2 ms added to every request, with nothing to batch it with.
        ready_at = min(it.enqueued for it in batch) + policy.max_wait_ms / 1000.0
        expected = (max(it.enqueued for it in live) + arrival_gap
                    if policy.adaptive_wait and arrival_gap is not None else now)
        if ready_at > now and expected < ready_at:
            decision.wait = min(ready_at, min(it.deadline for it in live)) - now
            return decision
    decision.batch = batch
    return decision


# The adaptive wait's estimate of the gap between requests: the weight of the newest gap, and its cap.
ARRIVAL_EWMA = 0.2
ARRIVAL_GAP_CAP_S = 1.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A lane's ready batch, as the choice between lanes sees it."""

    priority: int  # the batch head's own priority (ageing ranks items within a lane, not lanes)
    served: float  # the lane's device time so far, divided by its share (start-time fair queueing)
    deadline: float  # the earliest deadline in the batch


def choose_lane(candidates: Sequence[Candidate]) -> int:
    """Which lane's batch runs next: the highest priority first, then the lane that has had the least device
    time for its share (so a flooded model cannot starve another), then the nearest deadline, then the order
    the lanes were configured in."""
    return min(range(len(candidates)),
               key=lambda i: (-candidates[i].priority, candidates[i].served, candidates[i].deadline, i))


class QueueFull(Exception):
    pass


class QueueClosed(Exception):
    pass


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


@dataclass
class _Taker:
    """A ``take`` waiting for work: the lanes it accepts (None: all) and its own condition over the queue's lock."""

    lanes: Callable[[Lane], bool] | None
    cond: threading.Condition
    woken: bool = False


class BatchQueue:
    """Bounded, thread-safe pending lists, one lane per model; ``take`` blocks the worker until there is work.

    Each lane is scheduled by ``next_batch`` under its own policy; when several have a batch ready,
    ``choose_lane`` picks one. ``claim`` runs under the queue's lock on every batch ``take`` hands out, so
    whatever the batch needs (its model's reference) is held from the moment it is chosen: a ``remove`` that
    finds nothing left to take out knows the batch has its claim. ``post`` hands a callable to the taker's
    thread (chores).
    """

    def __init__(self, claim: Callable[[list[Any]], None] | None = None) -> None:
        """No lanes yet: ``add_lane`` adds each model's, with its own rules and bound."""
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the lock every method holds; takers wait on their own
        # Takers waiting for work, each on a condition of its own over the one lock: a put wakes one taker of its
        # lane, not every taker of every model (each wake-up is a thread the OS runs on the event loop's cores).
        self._idle: list[_Taker] = []
        self._closed = False
        self._seq = itertools.count()
        self._paused = False
        self._claim = claim
        self._chores: list[Callable[[], None]] = []

    # -- lanes -----------------------------------------------------------------------------------------

    def add_lane(self, name: str, policy: Policy, max_queue: int, share: float = 1.0, shadow: bool = False) -> None:
        """A model's lane, or new rules for it (its pending items stay; a retiring lane serves again)."""
        with self._cond:
            lane = self._lanes.get(name)
            if lane is None:
                self._lanes[name] = Lane(name, policy, max_queue, share, shadow=shadow)
            else:
                lane.policy, lane.max_queue, lane.share, lane.retiring = policy, max_queue, share, False
            self._wake_all()

    def retire_lane(self, name: str) -> None:
        """The model is no longer served: the lane takes nothing new; what it holds still runs, then it goes."""
        with self._cond:
            lane = self._lanes.get(name)
            if lane is not None:
                lane.retiring = True
                if not lane.pending:
                    del self._lanes[name]

    def lane_names(self) -> list[str]:
        with self._cond:
            return list(self._lanes)

    def max_queue(self, lane: str) -> int:
        with self._cond:
            found = self._lanes.get(lane)
            return found.max_queue if found is not None else 0

    def lane_rules(self, lane: str) -> tuple[Policy, int] | None:
        """A lane's policy and bound; None when there is no such lane (or it is retiring)."""
        with self._cond:
            found = self._lanes.get(lane)
            return None if found is None or found.retiring else (found.policy, found.max_queue)

    def depth(self, lane: str) -> int:
        found = self._lanes.get(lane)
        return len(found.pending) if found is not None else 0

    def __len__(self) -> int:
        return sum(len(lane.pending) for lane in list(self._lanes.values()))

    def next_seq(self) -> int:
        return next(self._seq)

    def put(self, items: Sequence[Any], lane: str) -> None:
        with self._cond:
            if self._closed:
                raise QueueClosed
            target = self._lanes.get(lane)
            if target is None or target.retiring:
                raise QueueClosed
            if len(target.pending) + len(items) > target.max_queue:
                raise QueueFull
            if not target.pending:
                # Back from idle: level with the busiest-served lane that is waiting, so that time spent idle is
                # not credit to spend monopolising the device afterwards.
                busy = [other.served for other in self._lanes.values() if other.pending]
                if busy:
                    target.served = max(target.served, min(busy))
            target.pending.extend(items)
            target.note_arrival(time.monotonic())
            self._wake_one(target)

    def charge(self, lane: str, seconds: float) -> None:
        """The worker's report of how long a batch of ``lane`` held the device (the fairness clock)."""
        with self._cond:
            found = self._lanes.get(lane)
            if found is not None:
                found.served += seconds / found.share

    def remove(self, items: Sequence[Any]) -> int:
        """Take items out if they are still pending; how many were (the worker has not taken those)."""
        ids = {id(it) for it in items}
        removed = 0
        with self._cond:
            for lane in self._lanes.values():
                before = len(lane.pending)
                lane.pending = [it for it in lane.pending if id(it) not in ids]
                removed += before - len(lane.pending)
            self._drop_retired()
            return removed

    def post(self, chore: Callable[[], None]) -> None:
        """Run ``chore`` on the thread that calls ``take`` (it comes back as ``Decision.chores``)."""
        with self._cond:
            self._chores.append(chore)
            self._wake_all()

    def take_chores(self) -> list[Callable[[], None]]:
        """The chores not yet handed out (for the taker's own shutdown: nothing may be left undone)."""
        with self._cond:
            chores, self._chores = self._chores, []
            return chores

    def pause(self, paused: bool) -> None:
        """Hold batches back (items still expire and drop). For operators and for tests of backpressure."""
        with self._cond:
            self._paused = paused
            self._wake_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._wake_all()

    def wake(self) -> None:
        """Wake every taker to look again (one was told to stop)."""
        with self._cond:
            self._wake_all()

    def drain_all(self, lanes: Callable[[Lane], bool] | None = None) -> list[Any]:
        """Take every pending item out (of the lanes ``lanes`` accepts; None: all)."""
        with self._cond:
            drained = [lane for lane in self._lanes.values() if lanes is None or lanes(lane)]
            items = [it for lane in drained for it in lane.pending]
            for lane in drained:
                lane.pending = []
            self._drop_retired()
            return items

    def _drop_retired(self) -> None:
        for name in [n for n, lane in self._lanes.items() if lane.retiring and not lane.pending]:
            del self._lanes[name]

    def _decide(self, now: float, lanes: Callable[[Lane], bool] | None = None) -> Decision[Any]:
        """One decision across the lanes ``lanes`` accepts (None: all): their expired and dropped items, and one
        lane's batch."""
        decision: Decision[Any] = Decision()
        ready: list[tuple[Lane, list[Any]]] = []
        waits = []
        # Shadow work waits while any live lane holds work, even work waiting for companions: it never delays it.
        live_waiting = any(lane.pending for lane in self._lanes.values() if not lane.shadow)
        for lane in self._lanes.values():
            if not lane.pending or (lanes is not None and not lanes(lane)):
                continue
            d = next_batch(lane.pending, now, lane.policy, lane.arrival_gap)
            decision.expired += d.expired
            decision.dropped += d.dropped
            if d.batch and lane.shadow and live_waiting:
                continue  # the live lanes' batches or waits decide when to look again
            if d.batch and not self._paused:
                ready.append((lane, d.batch))
            elif d.batch:  # paused: wake at the next deadline, to expire it
                waits.append(min(it.deadline for it in lane.pending) - now)
            elif d.wait is not None:
                waits.append(d.wait)
        if ready:
            chosen = choose_lane([Candidate(batch[0].priority, lane.served, min(it.deadline for it in batch))
                                  for lane, batch in ready])
            lane, decision.batch = ready[chosen]
            decision.lane = lane.name
        elif waits:
            decision.wait = max(0.0, min(waits))
        return decision

    def take(self, timeout: float | None = None, *, lanes: Callable[[Lane], bool] | None = None,
             chores: bool = True, stop: Callable[[], bool] | None = None) -> Decision[Any] | None:
        """The next decision with something in it; None once closed and empty (or on timeout).

        ``lanes``: only the lanes it accepts (a model instance's own; None: all); ``chores``: whether this taker
        runs posted chores; ``stop``: checked on each wake, None once it says so and nothing is ready for it.
        """
        give_up = None if timeout is None else time.monotonic() + timeout
        me = _Taker(lanes, threading.Condition(self._lock))
        with self._cond:
            while True:
                now = time.monotonic()
                decision = self._decide(now, lanes)
                if self._chores and chores:
                    decision.chores, self._chores = self._chores, []
                if not decision.empty or decision.chores:
                    taken = {id(it) for it in (*decision.batch, *decision.expired, *decision.dropped)}
                    if taken:
                        for lane in self._lanes.values():
                            lane.pending = [it for it in lane.pending if id(it) not in taken]
                        self._drop_retired()
                        if (not any(ln.pending for ln in self._lanes.values() if not ln.shadow)
                                and any(ln.pending for ln in self._lanes.values() if ln.shadow)):
                            # The shadow instance held its batch back while live work waited, with no wait of
                            # its own (the live lanes are not its lanes): this taker emptied them, so wake it, or
                            # it sleeps until the next put (a lost wakeup: shadow work stuck once load ended).
                            self._wake_all()
                        self._wake_for_pending()  # what this batch left behind: another idle taker's
                    if decision.batch and self._claim is not None:
                        self._claim(decision.batch)
                    return decision
                if self._closed and not any(lanes is None or lanes(lane) for lane in self._lanes.values()
                                            if lane.pending):
                    return None
                if stop is not None and stop():
                    return None
                wait = decision.wait
                if give_up is not None:
                    if now >= give_up:
                        return None
                    wait = give_up - now if wait is None else min(wait, give_up - now)
                me.woken = False
                self._idle.append(me)
                try:
                    me.cond.wait(wait)
                finally:
                    self._idle.remove(me)

    def _wake_all(self) -> None:
        """Every waiting taker looks again (under the lock)."""
        for taker in self._idle:
            taker.woken = True
            taker.cond.notify()

    def _wake_one(self, lane: Lane) -> None:
        """One waiting taker of ``lane`` looks again, unless one already is about to (under the lock)."""
        takers = [t for t in self._idle if t.lanes is None or t.lanes(lane)]
        if takers and not any(t.woken for t in takers):
            takers[0].woken = True
            takers[0].cond.notify()

    def _wake_for_pending(self) -> None:
        for lane in self._lanes.values():
            if lane.pending:
                self._wake_one(lane)
