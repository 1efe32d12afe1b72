"""The units of work: a request's Ticket, the WorkItems it is split into, its result, and refusals.

The engine's request side creates them on the event loop; the worker thread fills them in; only the loop
resolves a ticket's future (one call per batch).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from inferd.core.model_loader import ModelSlot
from inferd.core.preprocess import Encoded


class EngineError(Exception):
    """A refusal with an HTTP meaning; the API layer maps it onto the error shape."""

    def __init__(self, status: int, message: str, code: str, reason: str | None = None,
                 retry_after: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.reason, self.retry_after, self.param = reason, retry_after, param


class ClientGone(Exception):
    pass


class Ticket:
    """One request's share of the queue: its future, its results in order, and its stage timings."""

    __slots__ = ("future", "results", "remaining", "closed", "cancelled", "error", "slot", "queue_s",
                 "infer_s", "post_s", "batch_size", "_batches")

    def __init__(self, future: asyncio.Future, n: int, slot: ModelSlot) -> None:
        self.future = future
        self.results: list[Any] = [None] * n
        self.remaining = n
        self.closed = False  # answered or abandoned: its queued items are dropped
        self.cancelled = False
        self.error: EngineError | None = None
        self.slot = slot
        self.queue_s = self.infer_s = self.post_s = 0.0
        self.batch_size = 0
        self._batches: set[int] = set()


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
    group: object

    @property
    def gone(self) -> bool:
        return self.ticket.closed


@dataclass
class EmbedResult:
    vectors: list[Any]
    tokens: list[int]
    model: str
    version: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)


def tickets_of(items: list[WorkItem]) -> list[Ticket]:
    """The distinct tickets behind some items (a multi-text request has several items)."""
    return list({id(i.ticket): i.ticket for i in items}.values())


def settle(tickets: list[Ticket]) -> None:
    """On the event loop: wake each ticket's waiter (its outcome is on the ticket, never an exception)."""
    for t in tickets:
        if not t.future.done():
            t.future.set_result(None)
