"""The batch worker: its own thread takes the scheduler's decisions from the queue and runs them.

It runs each batch through the handler of the slot the queue claimed for it, splits a batch that runs out
of device memory in halves (so only what cannot fit fails), frees retired slots (the chores the manager
posts: freeing closes a handler and empties the device cache, which must not block the event loop), and
reports what happened as an outcome object (core/work.py: ``BatchReport`` or ``Failure``) handed to
``deliver``. It never writes a request's outcome itself: the event loop applies the outcome, and stays
the only writer of a ticket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from inferd.core.batcher import BatchQueue, Decision
from inferd.core.errors import EngineError, Kind, deadline_passed
from inferd.core.shadow import SHADOW_SUFFIX
from inferd.core.slots import ModelSlot
from inferd.core.work import BatchReport, Failure, Outcome, WorkItem, tickets_of
from inferd.utils import tracing
from inferd.utils.metrics import Metrics

log = logging.getLogger(__name__)
batch_log = logging.getLogger("inferd.batch")


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


def _failed() -> EngineError:
    return EngineError(Kind.FAILED, "inference failed for this batch")


def run_chores(chores: list[Callable[[], None]]) -> None:
    for chore in chores:
        try:
            chore()
        except Exception:
            log.exception("freeing a model failed")


class BatchWorker:
    def __init__(self, queue: BatchQueue, metrics: Metrics, memory_guard: Any,
                 deliver: Callable[[Outcome], None]) -> None:
        self.queue = queue
        self.metrics = metrics
        self.memory_guard = memory_guard
        self.deliver = deliver
        self.error: str | None = None  # why the thread died (for the log and /admin/models)
        self.batches_run = 0
        self._thread: threading.Thread | None = None

    # -- lifecycle (called from the event loop) --------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inferd-worker", daemon=True)
        self._thread.start()
        self.metrics.worker_alive.set(1)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stop(self, timeout: float) -> None:
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            run_chores(self.queue.take_chores())  # frees posted as the worker stopped

    def on_worker(self, chore: Callable[[], None]) -> None:
        """Run ``chore`` on the worker thread (a slot's free); here when this is the worker or there is none."""
        thread = self._thread
        if thread is None or not thread.is_alive() or threading.current_thread() is thread:
            run_chores([chore])
        else:
            self.queue.post(chore)

    # -- the thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        decision: Decision | None = None
        try:
            while True:
                decision = self.queue.take()
                if decision is None:
                    break
                try:
                    self._handle(decision)
                except Exception:
                    # A fault outside the handler (metrics, memory guard): fail this decision, keep serving.
                    log.exception("handling a batch failed; its requests fail, the worker carries on")
                    self.deliver(Failure(tickets_of([*decision.batch, *decision.expired]), _failed()))
                decision = None
        except BaseException as exc:  # the loop must never die silently: readiness reports it
            self.error = f"{type(exc).__name__}: {exc}"
            self.metrics.worker_alive.set(0)
            log.critical("inference worker died", exc_info=True)
            err = EngineError(Kind.WORKER_DEAD, "the inference worker stopped")
            # The batch in hand as well as the queue: none of their requests may wait for ever.
            in_hand = [] if decision is None else [*decision.batch, *decision.expired]
            self.deliver(Failure(tickets_of([*in_hand, *self.queue.drain_all()]), err))
            run_chores(self.queue.take_chores())
            raise

    def _handle(self, decision: Decision) -> None:
        expired = tickets_of(decision.expired)
        if expired:
            self.deliver(Failure(expired, deadline_passed()))
        if decision.batch:
            slot: ModelSlot = decision.batch[0].group  # type: ignore[assignment]
            started = time.monotonic()
            live = not decision.lane.endswith(SHADOW_SUFFIX)  # shadow work stays out of the live metrics
            try:
                report = self._run_batch(slot, decision.batch, live)
            finally:
                slot.release()  # the claim the queue took for this batch; a retired slot is freed here
                # The device time the lane's model took: the fair share between models (core/batcher.py).
                self.queue.charge(decision.lane, time.monotonic() - started)
            if report is not None:
                self.deliver(report)
            if live:
                self.metrics.queue_depth.labels(slot.spec.name).set(self.queue.depth(decision.lane))
        run_chores(decision.chores)
        if self.memory_guard is not None and decision.batch:
            self.memory_guard.tick(len({id(i.ticket) for i in decision.batch}))

    def _run_batch(self, slot: ModelSlot, batch: list[WorkItem], live: bool = True) -> BatchReport | None:
        # Requests that left since the batch was chosen are not computed for.
        batch = [it for it in batch if not it.ticket.closed]
        if not batch:
            return None
        started = time.monotonic()
        if not slot.usable:
            # Cannot happen while requests keep their items' slot (core/admission.py); if it ever does,
            # refuse rather than run on a model that is being freed.
            log.error("a batch was handed out on a released model", extra={"version": slot.version})
            err = EngineError(Kind.MODEL_UNLOADED, "the model this request was routed to was unloaded; retry")
            return BatchReport(0, started, 0.0, 0.0, len(batch), [(it, err) for it in batch])
        span = tracing.start_batch(batch)  # None when tracing is off (or none of its requests is traced)
        timing = [0.0, 0.0]
        results = self._infer_split(slot, batch, timing)
        infer_s, post_s = timing
        n = len(batch)
        longest = max(it.tokens for it in batch)
        model, version = slot.spec.name, slot.version
        real_tokens = sum(it.tokens for it in batch)
        traced: dict[str, Any] = {}
        if span is not None:
            span.end(size=n, padded_tokens=longest * n, tokens=real_tokens, model=model, version=version,
                     failed=sum(isinstance(r, EngineError) for r in results))
            traced = {"trace_id": span.trace_id, "trace_ids": span.trace_ids}
        m = self.metrics
        if live:
            m.batch_size.labels(model, version).observe(n)
            m.batch_tokens.labels(model, version).observe(longest * n)
            m.inference_duration.labels(model, version).observe(infer_s)
            m.postprocess_duration.labels(model, version).observe(post_s)
            queued = m.queue_duration.labels(model, version)
            for item in batch:
                queued.observe(started - item.enqueued)
        self.batches_run += 1
        batch_log.info("batch", extra={"batch_size": n, "batch_tokens": longest * n, "real_tokens": real_tokens,
                                       "inference_ms": round(infer_s * 1e3, 3),
                                       "postprocess_ms": round(post_s * 1e3, 3),
                                       "duration_ms": round((time.monotonic() - started) * 1e3, 3),
                                       "model": model, "version": version, **traced})
        return BatchReport(self.batches_run, started, infer_s, post_s, n,
                           list(zip(batch, results, strict=True)), span)

    def _infer_split(self, slot: ModelSlot, items: list[WorkItem], timing: list[float]) -> list[Any]:
        """Run items as one batch; on out-of-memory split in halves so only what cannot fit fails."""
        handler = slot.handler
        try:
            t0 = time.perf_counter()
            outputs = handler.infer([it.encoded for it in items])
            t1 = time.perf_counter()
            results = handler.postprocess(outputs)
            timing[0] += t1 - t0
            timing[1] += time.perf_counter() - t1
            if len(results) != len(items):
                raise RuntimeError(f"handler returned {len(results)} results for a batch of {len(items)}")
            return list(results)
        except Exception as exc:
            if _is_oom(exc):
                self.metrics.oom.inc()
                if self.memory_guard is not None:
                    self.memory_guard.after_oom()
                if len(items) > 1:
                    mid = len(items) // 2
                    log.warning("out of memory in a batch of %d; retrying in halves", len(items))
                    return self._infer_split(slot, items[:mid], timing) + self._infer_split(
                        slot, items[mid:], timing)
                return [EngineError(Kind.OOM, "out of memory computing this input even alone; send a shorter "
                                    "text or retry later")]
            log.exception("batch of %d failed", len(items))
            return [_failed()] * len(items)
