"""One batch computed on its slot: the handler's pass, out-of-memory split in halves, and what the batch reports.

The worker (core/worker.py) decides when and on which threads a batch runs and holds its claim on the slot; this
computes it: the items whose requests are gone are left out, the batch runs through its handler (on out-of-memory
in halves, so only what cannot fit fails, each failure an error in the item's place), and its metrics, trace span
and log line are written. The answers go back in a ``BatchReport`` (core/outcomes.py) for the event loop to apply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from inferd.core.errors import EngineError, Kind
from inferd.core.outcomes import BatchReport, WorkItem
from inferd.core.slots import ModelSlot
from inferd.core.staging import same_batch
from inferd.utils import tracing
from inferd.utils.metrics import Metrics

log = logging.getLogger(__name__)
batch_log = logging.getLogger("inferd.batch")


def failed_batch() -> EngineError:
    return EngineError(Kind.FAILED, "inference failed for this batch")


class BatchComputer:
    """One worker's batches: ``running`` is the context its passes run in (a GPU instance's own stream)."""

    def __init__(self, metrics: Metrics, memory_guard: Any,
                 running: Callable[[], AbstractContextManager[Any]]) -> None:
        self.metrics = metrics
        self.memory_guard = memory_guard
        self._running = running
        self.batches_run = 0

    def compute(self, slot: ModelSlot, batch: list[WorkItem], live: bool = True,
                staged: Any = None) -> BatchReport | None:
        """The batch's answers, one per item still wanted, in a report for the event loop (None: nobody is left);
        ``live``: counted in the live metrics (not shadow work); ``staged``: its inputs already on the device."""
        # Requests that left since the batch was chosen are not computed for.
        batch = [it for it in batch if not it.ticket.closed]
        if not batch:
            return None
        if staged is not None and not same_batch(staged, [it.encoded for it in batch]):
            staged = None  # staged for the batch as it was taken: the smaller one is collated afresh
        started = time.monotonic()
        if not slot.usable:
            # Cannot happen while requests keep their items' slot (core/admission.py); if it ever does,
            # refuse rather than run on a model that is being freed.
            log.error("a batch was handed out on a released model", extra={"version": slot.version})
            err = EngineError(Kind.MODEL_UNLOADED, "the model this request was routed to was unloaded; retry")
            return BatchReport(0, started, 0.0, 0.0, len(batch), [(it, err) for it in batch])
        span = tracing.start_batch(batch)  # None when tracing is off (or none of its requests is traced)
        timing = [0.0, 0.0]
        results = self._infer_split(slot, batch, timing, staged)
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
        if batch_log.isEnabledFor(logging.INFO):  # the line's fields are built only when it is written
            batch_log.info("batch", extra={"batch_size": n, "batch_tokens": longest * n, "real_tokens": real_tokens,
                                           "inference_ms": round(infer_s * 1e3, 3),
                                           "postprocess_ms": round(post_s * 1e3, 3),
                                           "duration_ms": round((time.monotonic() - started) * 1e3, 3),
                                           "model": model, "version": version, **traced})
        return BatchReport(self.batches_run, started, infer_s, post_s, n,
                           list(zip(batch, results, strict=True)), span)

    def _infer_split(self, slot: ModelSlot, items: list[WorkItem], timing: list[float],
                     staged: Any = None) -> list[Any]:
        """Run items as one batch (``staged``: their inputs already on the device); on out-of-memory split in
        halves so only what cannot fit fails."""
        handler = slot.handler
        try:
            with self._running():  # on a GPU, this instance's own stream: the postprocess's copy out waits for it alone
                t0 = time.perf_counter()
                outputs = handler.infer(staged if staged is not None else [it.encoded for it in items])
                t1 = time.perf_counter()
                results = handler.postprocess(outputs)
            timing[0] += t1 - t0
            timing[1] += time.perf_counter() - t1
            if len(results) != len(items):
                raise RuntimeError(f"handler returned {len(results)} results for a batch of {len(items)}")
            return list(results)
        except Exception as exc:
            if isinstance(exc, torch.OutOfMemoryError):
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
            return [failed_batch()] * len(items)
