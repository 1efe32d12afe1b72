"""The batch queue: bounded, thread-safe lanes (one per model) and the hand-out of their batches to the workers.

Each lane is scheduled by the pure ``next_batch`` (core/scheduler.py) under its own policy; when several have a batch
ready, ``choose_lane`` (core/lanes.py) picks one. This module holds the lock, wakes the takers that can use new work,
and takes what it hands out off the lanes. It knows nothing of HTTP or torch: an item is opaque work.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic

from inferd.core.lanes import Lane, ReadyBatch, choose_lane
from inferd.core.scheduler import Item, Policy, is_background, next_batch


class QueueFull(Exception):
    pass


class QueueClosed(Exception):
    pass


@dataclass
class Handout(Generic[Item]):
    """What ``take`` hands a worker: one lane's batch (claimed), the expired and dropped items of every lane it
    serves, and the calls posted to its thread."""

    batch: list[Item] = field(default_factory=list)
    expired: list[Item] = field(default_factory=list)
    dropped: list[Item] = field(default_factory=list)
    lane: str = ""  # the lane (model) the batch is of
    posted: list[Callable[[], None]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.batch or self.expired or self.dropped)


@dataclass
class _Taker:
    """A ``take`` waiting for work: the lanes it accepts (None: all), the work it takes (``background``: see
    ``BatchQueue.take``) and its own condition over the queue's lock."""

    lanes: Callable[[Lane], bool] | None
    cond: threading.Condition
    background: bool | None = None
    woken: bool = False

    def wants(self, lane: Lane, background: bool | None) -> bool:
        """Whether it takes ``lane``'s work of that kind (None: of either kind)."""
        return ((self.lanes is None or self.lanes(lane))
                and (self.background is None or background is None or self.background == background))


def _of_kind(items: list[Any], background: bool | None) -> list[Any]:
    """The items a taker of ``background`` work takes (None: all of them)."""
    return items if background is None else [it for it in items if is_background(it) == background]


def _holds_live(pending: list[Any]) -> bool:
    """Whether any of a lane's pending items is live (not a batch job's background line)."""
    return not all(is_background(item) for item in pending)


class BatchQueue:
    """Bounded, thread-safe pending lists, one lane per model; ``take`` blocks the worker until there is work.

    Each lane is scheduled by ``next_batch`` under its own policy; when several have a batch ready,
    ``choose_lane`` picks one. ``claim`` runs under the queue's lock on every batch ``take`` hands out, so
    whatever the batch needs (its model's reference) is held from the moment it is chosen: a ``remove`` that
    finds nothing left to take out knows the batch has its claim. ``post`` hands a call to the taker's thread
    (a slot's free must run on the worker, not on the event loop).
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
        self._posted: list[Callable[[], None]] = []
        # The largest bound of a model's lane (not a shadow's, not a retiring one's), kept as lanes change so that
        # a request's limits (InferenceEngine.limits, per request on the event loop) read it without the lock.
        self._largest_bound = 0

    # -- lanes -----------------------------------------------------------------------------------------

    def add_lane(self, name: str, policy: Policy, max_queue: int, share: float = 1.0, shadow: bool = False) -> None:
        """A model's lane, or new rules for it (its pending items stay; a retiring lane serves again)."""
        with self._cond:
            lane = self._lanes.get(name)
            if lane is None:
                self._lanes[name] = Lane(name, policy, max_queue, share, shadow=shadow)
            else:
                lane.policy, lane.max_queue, lane.share, lane.retiring = policy, max_queue, share, False
            self._rebound()
            self._wake_all()

    def retire_lane(self, name: str) -> None:
        """The model is no longer served: the lane takes nothing new; what it holds still runs, then it goes."""
        with self._cond:
            lane = self._lanes.get(name)
            if lane is not None:
                lane.retiring = True
                if not lane.pending:
                    del self._lanes[name]
                self._rebound()

    def _rebound(self) -> None:
        """Under the lock, after a lane's bound or state changed (rare: a model added, removed or reconfigured)."""
        self._largest_bound = max((lane.max_queue for lane in self._lanes.values()
                                   if not lane.shadow and not lane.retiring), default=0)

    @property
    def largest_bound(self) -> int:
        """The largest ``max_queue`` of the models' lanes (0: none): the most items one request may hold here.
        One int read, no lock: it is written whole under the lock whenever a lane changes."""
        return self._largest_bound

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

    def live_waiting(self, lane: str) -> bool:
        """Whether ``lane`` holds a live item now (its background items not counted): a burst, for core/worker.py."""
        found = self._lanes.get(lane)
        return found is not None and _holds_live(list(found.pending))

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
            now = time.monotonic()
            target.note_arrival(now)
            background = bool(items) and is_background(items[0])  # one request's items share its priority
            if items and not background:
                target.last_live = now
            self._wake_one(target, background)

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
        """Run ``chore`` on the thread that calls ``take`` (it comes back in ``Handout.posted``)."""
        with self._cond:
            self._posted.append(chore)
            self._wake_all()

    def take_posted(self) -> list[Callable[[], None]]:
        """The posted calls not yet handed out (for the taker's own shutdown: nothing may be left undone)."""
        with self._cond:
            posted, self._posted = self._posted, []
            return posted

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

    def drain_all(self, lanes: Callable[[Lane], bool] | None = None, background: bool | None = None) -> list[Any]:
        """Take every pending item out (of the lanes ``lanes`` accepts, None: all; of the kind ``background``
        names, None: both)."""
        with self._cond:
            drained = [lane for lane in self._lanes.values() if lanes is None or lanes(lane)]
            items = [it for lane in drained for it in _of_kind(lane.pending, background)]
            taken = {id(it) for it in items}
            for lane in drained:
                lane.pending = [it for it in lane.pending if id(it) not in taken]
            self._drop_retired()
            return items

    def _drop_retired(self) -> None:
        for name in [n for n, lane in self._lanes.items() if lane.retiring and not lane.pending]:
            del self._lanes[name]

    def _decide(self, now: float, lanes: Callable[[Lane], bool] | None = None,
                background: bool | None = None) -> tuple[Handout[Any], float | None]:
        """One hand-out across the lanes ``lanes`` accepts (None: all), of the work ``background`` names (None:
        both kinds): their expired and dropped items, and one lane's batch; with the seconds until it could change
        without new input (None: only new input changes it)."""
        handout: Handout[Any] = Handout()
        ready: list[tuple[Lane, list[Any]]] = []
        waits = []
        # Shadow work waits while any live lane holds work, even work waiting for companions: it never delays it.
        live_waiting = any(lane.pending for lane in self._lanes.values() if not lane.shadow)
        for lane in self._lanes.values():
            if not lane.pending or (lanes is not None and not lanes(lane)):
                continue
            pending = _of_kind(lane.pending, background)
            if not pending:
                continue
            d = next_batch(pending, now, lane.policy, lane.arrival_gap, lane.last_live)
            handout.expired += d.expired
            handout.dropped += d.dropped
            if d.batch and lane.shadow and live_waiting:
                continue  # the live lanes' batches or waits decide when to look again
            if d.batch and not self._paused:
                ready.append((lane, d.batch))
            elif d.batch:  # paused: wake at the next deadline, to expire it
                waits.append(min(it.deadline for it in lane.pending) - now)
            elif d.wait is not None:
                waits.append(d.wait)
        if ready:
            chosen = choose_lane([ReadyBatch(batch[0].priority, lane.served, min(it.deadline for it in batch))
                                  for lane, batch in ready])
            lane, handout.batch = ready[chosen]
            handout.lane = lane.name
            return handout, None
        return handout, max(0.0, min(waits)) if waits else None

    def take(self, timeout: float | None = None, *, lanes: Callable[[Lane], bool] | None = None,
             background: bool | None | Callable[[], bool | None] = None, runs_posted: bool = True,
             stop: Callable[[], bool] | None = None) -> Handout[Any] | None:
        """The next hand-out with something in it; None once closed and empty (or on timeout).

        ``lanes``: only the lanes it accepts (a model instance's own; None: all); ``background``: True takes only
        background items (batch jobs' lines: core/scheduler.py ``is_background``), False only the others, None both
        (core/background.py: a model's background worker and its live instances), or a function of none saying which,
        read on each wake (a reload of the settings may change it); ``runs_posted``: whether this
        taker runs posted calls; ``stop``: checked on each wake, None once it says so and nothing is ready for it.
        """
        give_up = None if timeout is None else time.monotonic() + timeout
        kind = background if callable(background) else (lambda: background)
        me = _Taker(lanes, threading.Condition(self._lock), kind())
        with self._cond:
            while True:
                now = time.monotonic()
                before, me.background = me.background, kind()
                handout, wait = self._decide(now, lanes, me.background)
                if self._posted and runs_posted:
                    handout.posted, self._posted = self._posted, []
                if not handout.empty or handout.posted:
                    taken = {id(it) for it in (*handout.batch, *handout.expired, *handout.dropped)}
                    if taken:
                        for lane in self._lanes.values():
                            lane.pending = [it for it in lane.pending if id(it) not in taken]
                        self._drop_retired()
                        if (not any(ln.pending for ln in self._lanes.values() if not ln.shadow)
                                and any(ln.pending for ln in self._lanes.values() if ln.shadow)):
                            # The shadow instance held its batch back while live work waited, with no wait of
                            # its own (the live lanes are not its lanes): this taker emptied them, so wake it, or
                            # it would sleep until the next put: once live load ends, shadow work would wait for ever.
                            self._wake_all()
                        self._wake_for_pending()  # what this batch left behind: another idle taker's
                    if handout.batch and self._claim is not None:
                        self._claim(handout.batch)
                    return handout
                if me.background != before:
                    # What it takes changed while it slept (a settings reload), and it took nothing: a wake meant for
                    # it as the taker of the other kind (``_wake_one`` wakes one taker of a kind, and none while one
                    # is woken) goes on to a taker of that kind, or that work waits for the next put.
                    self._wake_for_pending()
                if self._closed and not any(_of_kind(lane.pending, me.background) for lane in self._lanes.values()
                                            if lanes is None or lanes(lane)):
                    return None
                if stop is not None and stop():
                    return None
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

    def _wake_one(self, lane: Lane, background: bool) -> None:
        """One waiting taker of ``lane``'s work of that kind looks again, unless one already is about to (under
        the lock)."""
        takers = [t for t in self._idle if t.wants(lane, background)]
        if takers and not any(t.woken for t in takers):
            takers[0].woken = True
            takers[0].cond.notify()

    def _wake_for_pending(self) -> None:
        for lane in self._lanes.values():
            kinds: set[bool] = set()
            for it in lane.pending:
                kinds.add(is_background(it))
                if len(kinds) == 2:
                    break
            for background in kinds:
                self._wake_one(lane, background)
