"""The units of work: a request's Ticket, the WorkItems it is split into, and the outcomes between the
event loop (admission) and the worker thread.

The admission side creates tickets and items on the event loop. The event loop is also the only writer of
a ticket's outcome (results, error, closed): the worker thread reports what it computed as an ``Outcome``
(a ``BatchReport``, or a ``Failure`` of whole requests) and the loop applies it, so an answer given by the
loop (the deadline, client gone, drain) can never be overwritten by a late result from the worker — the first
outcome wins, and only one thread decides which was first.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferd.core.description import ModelDescription
from inferd.core.errors import EngineError
from inferd.core.preprocess import Encoded
from inferd.core.slots import ModelSlot
from inferd.utils.tracing import BatchSpan, QueueTrace


class Ticket:
    """One request's share of the queue: its future, its results in order, and its stage timings."""

    __slots__ = ("future", "results", "remaining", "closed", "error", "queue_s", "infer_s", "post_s",
                 "batch_size", "trace", "_batches")

    def __init__(self, future: asyncio.Future, n: int, trace: QueueTrace | None = None) -> None:
        self.future = future
        self.results: list[Any] = [None] * n
        self.remaining = n
        self.closed = False  # answered or abandoned: its queued items are dropped (the worker only reads it)
        self.error: EngineError | None = None
        self.queue_s = self.infer_s = self.post_s = 0.0
        self.batch_size = 0
        self.trace = trace  # the request's queue and inference spans (utils/tracing.py); None untraced
        self._batches: set[int] = set()

    def close(self, error: EngineError | None = None) -> bool:
        """On the event loop: answer the request (with ``error``, or its results); False if already answered."""
        if self.closed:
            return False
        self.closed = True
        self.error = error
        if self.trace is not None:
            self.trace.answered(error)
        if not self.future.done():
            self.future.set_result(None)
        return True


@dataclass(slots=True, eq=False)
class WorkItem:
    ticket: Ticket
    index: int
    encoded: Encoded
    tokens: int
    priority: int
    enqueued: float
    deadline: float
    seq: int
    slot: ModelSlot  # the load it must run on: the scheduler batches by it (core/scheduler.py Slot)

    @property
    def gone(self) -> bool:
        return self.ticket.closed


@dataclass(slots=True)
class BatchReport:
    """What the worker learned from one batch, for the event loop to apply: one result (or error) per item."""

    key: int
    started: float
    infer_s: float
    post_s: float
    size: int
    results: list[tuple[WorkItem, Any]]
    trace: BatchSpan | None = None  # the batch's span, when a request it ran is traced

    def apply(self) -> None:
        """On the event loop: fill in each item's ticket; a ticket answered meanwhile keeps its answer."""
        for item, result in self.results:
            t = item.ticket
            if t.closed:
                continue
            t.queue_s = max(t.queue_s, self.started - item.enqueued)
            if self.key not in t._batches:
                t._batches.add(self.key)
                t.infer_s += self.infer_s
                t.post_s += self.post_s
                t.batch_size = max(t.batch_size, self.size)
                if self.trace is not None and t.trace is not None:
                    t.trace.ran_in(self.trace)
            if isinstance(result, EngineError):
                t.close(result)
                continue
            t.results[item.index] = result
            t.remaining -= 1
            if t.remaining == 0:
                t.close()


@dataclass(slots=True)
class Failure:
    """Whole requests answered with one error (expired in the queue, a batch that could not run, a dead
    worker, a drain that ran out of time): for the event loop to apply; an answered ticket keeps its answer."""

    tickets: list[Ticket]
    error: EngineError

    def apply(self) -> None:
        for t in self.tickets:
            t.close(self.error)


Outcome = BatchReport | Failure


@dataclass
class TaskResult:
    """A request's answer: one opaque result per input, in order, and the description of the model load that
    computed them, by which the task's routes shape them (never a slot looked up again: a canary's answer is
    shaped by the canary's description, and one computed just before a switch by the model switched out).

    ``calibration`` holds that load's int8/uint8 calibration vectors (full size) when the request asked for them.
    """

    outputs: list[Any]
    tokens: list[int]
    description: ModelDescription
    timings: dict[str, float] = field(default_factory=dict)
    calibration: np.ndarray | None = None

    @property
    def model(self) -> str:
        return self.description.name

    @property
    def version(self) -> str:
        return self.description.version

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)


def tickets_of(items: list[WorkItem]) -> list[Ticket]:
    """The distinct tickets behind some items (a multi-text request has several items)."""
    return list({id(i.ticket): i.ticket for i in items}.values())


def merged_timings(results: list[TaskResult]) -> dict[str, float]:
    """The stage timings of one request answered by several (a document's pieces or windows): each stage's seconds
    added up, the batch size the largest any of them ran in."""
    timings: dict[str, float] = {}
    for r in results:
        for key, value in r.timings.items():
            timings[key] = max(timings.get(key, 0), value) if key == "batch_size" else timings.get(key, 0) + value
    return timings
