"""The batch worker alone, on a real queue: it runs what the scheduler hands out and reports outcomes;
it never writes a request's outcome itself (the event loop applies what it reports)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fakes import HashHandler, encode, opened, vector_for

from inferd.core.batcher import BatchQueue
from inferd.core.errors import Kind
from inferd.core.outcomes import BatchReport, Failure, Outcome, Ticket, WorkItem
from inferd.core.scheduler import Policy
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec
from inferd.core.worker import BatchWorker
from inferd.utils.metrics import Metrics


class OomHandler(HashHandler):
    """Out of memory on any batch holding an ``oom`` text with anything else, and on that text alone."""

    def infer(self, batch: list) -> list[str]:
        texts = super().infer(batch)
        if any(t.startswith("oom") for t in texts):
            raise torch.OutOfMemoryError("fake: out of memory")
        return texts


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()  # only for futures: nothing runs on it
    yield loop
    loop.close()


def run_worker(handler: HashHandler, tmp_path: Path, loop: asyncio.AbstractEventLoop,
               requests: list[list[str]], deadline_s: float = 60.0) -> tuple[list[Ticket], list[Outcome]]:
    """Queue the requests (paused, so they form one batch), let the worker run them, stop it."""
    slot = ModelSlot(opened(handler, ModelSpec(tmp_path, "1")), ModelSpec(tmp_path, "1"), 0.0)
    queue = BatchQueue(claim=lambda b: b[0].slot.acquire())
    queue.add_lane("m", Policy(max_batch_size=16, max_wait_ms=0.0), 64)
    outcomes: list[Outcome] = []
    delivered = threading.Event()
    worker = BatchWorker(queue, Metrics(16), None, deliver=lambda o: (outcomes.append(o), delivered.set()))
    now = time.monotonic()
    tickets = []
    queue.pause(True)
    for texts in requests:
        ticket = Ticket(loop.create_future(), len(texts))
        tickets.append(ticket)
        queue.put([WorkItem(ticket, i, encode(t), len(t), 0, now, now + deadline_s, queue.next_seq(), slot)
                   for i, t in enumerate(texts)], "m")
    worker.start()
    queue.pause(False)
    assert delivered.wait(10)
    worker.stop(5.0)
    assert not worker.alive and worker.error is None
    return tickets, outcomes


def test_a_batch_is_reported_and_only_the_loop_applies_it(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    handler = HashHandler()
    tickets, outcomes = run_worker(handler, tmp_path, loop, [["a", "b"], ["c"]])
    assert handler.batches == [["a", "b", "c"]]
    [report] = outcomes
    assert isinstance(report, BatchReport) and report.size == 3
    # Computed, reported, and not yet written: the tickets are the loop's to answer.
    assert all(not t.closed and t.remaining for t in tickets)
    report.apply()
    assert tickets[0].closed and tickets[0].results == [vector_for("a"), vector_for("b")]
    assert tickets[1].closed and tickets[1].results == [vector_for("c")] and tickets[1].batch_size == 3


def test_out_of_memory_splits_the_batch_and_fails_only_what_cannot_fit(
        tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    handler = OomHandler()
    tickets, outcomes = run_worker(handler, tmp_path, loop, [["a"], ["oom"], ["b"], ["c"]])
    [report] = outcomes
    assert isinstance(report, BatchReport)
    report.apply()
    ok = [tickets[i] for i in (0, 2, 3)]
    assert all(t.error is None for t in ok) and [t.results for t in ok] == [[vector_for(x)] for x in "abc"]
    assert tickets[1].error is not None and tickets[1].error.kind is Kind.OOM
    assert ["oom"] in handler.batches and len(handler.batches[0]) == 4  # whole, then halves down to it alone


def test_work_expired_in_the_queue_is_reported_as_a_deadline_failure_and_never_run(
        tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    handler = HashHandler()
    tickets, outcomes = run_worker(handler, tmp_path, loop, [["late"]], deadline_s=-1.0)
    [failure] = outcomes
    assert isinstance(failure, Failure) and failure.tickets == tickets and failure.error.kind is Kind.DEADLINE
    assert handler.batches == [] and not tickets[0].closed
    failure.apply()
    assert tickets[0].closed and tickets[0].error is failure.error
