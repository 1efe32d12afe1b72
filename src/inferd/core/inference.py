"""The inference engine: admits requests, splits them into items, and runs batches on a worker thread.

The event loop only tokenises (cheap, and overlapping the running batch: the pipelining) and waits on one
future per request. The worker thread takes batches from the queue, runs the handler under
``torch.inference_mode``, and resolves all the batch's requests with one call into the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from inferd.config import Settings
from inferd.core.batcher import BatchQueue, Decision, Policy, QueueClosed, QueueFull
from inferd.core.cache import EmbeddingCache
from inferd.core.model_loader import ModelManager, ModelNotReady, ModelSlot
from inferd.core.preprocess import InputError, check_texts
from inferd.core.work import ClientGone, EmbedResult, EngineError, Ticket, WorkItem, settle, tickets_of
from inferd.utils.metrics import Metrics

__all__ = ["ClientGone", "EmbedResult", "EngineError", "InferenceEngine"]

log = logging.getLogger(__name__)
batch_log = logging.getLogger("inferd.batch")

# Below this many characters a request is tokenised on the event loop; above, in a thread.
_INLINE_TOKENIZE_CHARS = 4096


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


class InferenceEngine:
    def __init__(self, manager: ModelManager, settings: Settings, metrics: Metrics,
                 memory_guard: Any = None) -> None:
        self.manager = manager
        self.settings = settings
        self.metrics = metrics
        self.memory_guard = memory_guard
        self.policy = Policy.from_settings(settings.batching)
        self.queue = BatchQueue(self.policy, settings.batching.max_queue)
        self.cache = (EmbeddingCache(settings.cache.max_entries, metrics) if settings.cache.max_entries
                      else None)
        self.in_flight = 0
        self.draining = False
        self.worker_error: str | None = None
        self.batches_run = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle = asyncio.Event()
        # Accepted requests not yet answered (queued or running): a drain that times out answers them all.
        self._open: set[Ticket] = set()
        self._abandoned = False

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="inferd-worker", daemon=True)
        self._thread.start()
        self.metrics.worker_alive.set(1)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.worker_error is None

    def stop(self, timeout: float = 5.0) -> None:
        self.queue.close()
        if self._thread is not None:
            # After a timed-out drain the worker is stuck in a batch; waiting longer would only delay exit.
            self._thread.join(0.1 if self._abandoned else timeout)

    async def drain(self, timeout: float) -> bool:
        """Refuse new work, wait for what was accepted; past the timeout answer the rest with 503."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            # Queued and running alike: a request still unanswered now gets 503 rather than hang.
            stuck = {id(i.ticket): i.ticket for i in self.queue.drain_all()}
            stuck.update((id(t), t) for t in self._open)
            err = EngineError(503, "the server is shutting down; retry on another instance",
                              "draining", "draining", retry_after=1)
            self._abandoned = any(not t.closed for t in stuck.values())
            self._resolve(list(stuck.values()), err)
            return False

    # -- the request side (event loop) -----------------------------------------------------------------

    async def embed(self, texts: list[Any], *, priority: int = 0, timeout_ms: float | None = None,
                    routing_key: str | None = None, model: str | None = None,
                    disconnected: Callable[[], Awaitable[Any]] | None = None) -> EmbedResult:
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise EngineError(503, "the server is draining; retry on another instance", "draining",
                              "draining", retry_after=1)
        if not self.alive:
            raise EngineError(503, f"the inference worker is not running: {self.worker_error or 'stopped'}",
                              "worker_dead", "not_ready", retry_after=5)
        limits = self.settings.limits
        try:
            texts = check_texts(texts, limits.max_items_per_request, limits.max_chars_per_text)
            if len(texts) > self.queue.max_queue:
                # 503 + Retry-After would promise a retry that can never fit in the queue.
                raise InputError(None, f"{len(texts)} texts given; at most {self.queue.max_queue} "
                                 "(batching.max_queue) per request", "too_many_items")
        except InputError as exc:
            raise self._input_error(exc) from None
        if self.settings.model.load_mode == "lazy":
            try:
                await self.manager.ensure_loaded()
            except ModelNotReady as exc:
                raise self._not_ready(exc) from None
        try:
            slot = self.manager.pick(routing_key, model)
        except ModelNotReady as exc:
            raise self._not_ready(exc) from None
        self._enter()
        try:
            if self.cache is None:
                return await self._embed_on(slot, texts, priority, timeout_ms, disconnected)
            return await self._embed_cached(slot, texts, priority, timeout_ms, disconnected)
        finally:
            slot.release()
            self._leave()

    async def _embed_on(self, slot: ModelSlot, texts: list[str], priority: int, timeout_ms: float | None,
                        disconnected: Callable[[], Awaitable[Any]] | None) -> EmbedResult:
        t0 = time.perf_counter()
        try:
            if sum(map(len, texts)) <= _INLINE_TOKENIZE_CHARS:
                encoded = slot.handler.preprocess(texts)
            else:
                encoded = await asyncio.to_thread(slot.handler.preprocess, texts)
        except InputError as exc:
            raise self._input_error(exc) from None
        pre_s = time.perf_counter() - t0
        version = slot.version
        self.metrics.preprocess_duration.labels(version).observe(pre_s)
        if self.settings.batching.oversize == "reject":
            for i, enc in enumerate(encoded):
                if enc.tokens > self.policy.max_batch_tokens:
                    raise self._input_error(InputError(
                        i, f"has {enc.tokens} tokens, more than batching.max_batch_tokens "
                        f"({self.policy.max_batch_tokens})", "too_many_tokens"))
        assert self._loop is not None
        ticket = Ticket(self._loop.create_future(), len(encoded), slot)
        now = time.monotonic()
        deadline = now + (timeout_ms or self.settings.batching.default_timeout_ms) / 1000.0
        items = [WorkItem(ticket, i, enc, enc.tokens, priority, now, deadline, self.queue.next_seq(), slot)
                 for i, enc in enumerate(encoded)]
        try:
            self.queue.put(items)
        except QueueFull:
            self.metrics.rejected.labels("overloaded").inc()
            raise EngineError(503, "the request queue is full; retry shortly", "queue_full", None,
                              retry_after=1) from None
        except QueueClosed:
            raise EngineError(503, "the server is shutting down", "draining", "draining",
                              retry_after=1) from None
        self.metrics.queue_depth.set(len(self.queue))
        self._open.add(ticket)
        try:
            await self._wait(ticket, items, deadline, disconnected)
        finally:
            self._open.discard(ticket)
        if ticket.error is not None:
            raise ticket.error
        return EmbedResult(
            vectors=ticket.results, tokens=[e.tokens for e in encoded], model=slot.spec.name, version=version,
            timings={"preprocess_ms": pre_s * 1e3, "queue_ms": ticket.queue_s * 1e3,
                     "inference_ms": ticket.infer_s * 1e3, "postprocess_ms": ticket.post_s * 1e3,
                     "batch_size": ticket.batch_size, "items": len(encoded)})

    async def _embed_cached(self, slot: ModelSlot, texts: list[str], priority: int, timeout_ms: float | None,
                            disconnected: Callable[[], Awaitable[Any]] | None) -> EmbedResult:
        """Answer what the cache holds; queue only the rest, then remember it."""
        assert self.cache is not None
        hits = self.cache.lookup(slot.version, texts)
        todo = [i for i in range(len(texts)) if i not in hits]
        fresh = EmbedResult([], [], slot.spec.name, slot.version, {"batch_size": 0, "items": 0})
        if todo:
            try:
                fresh = await self._embed_on(slot, [texts[i] for i in todo], priority, timeout_ms, disconnected)
            except EngineError as exc:
                if exc.param is not None:  # an index into the texts sent on: map it back to the request's
                    exc.param = str(todo[int(exc.param)])
                raise
            self.cache.store(slot.version, [texts[i] for i in todo], fresh.vectors, fresh.tokens)
        vectors: list[Any] = [None] * len(texts)
        tokens = [0] * len(texts)
        for i, (vector, count) in hits.items():
            vectors[i], tokens[i] = vector, count
        for j, i in enumerate(todo):
            vectors[i], tokens[i] = fresh.vectors[j], fresh.tokens[j]
        timings = {**fresh.timings, "items": len(texts), "cache_hits": len(hits)}
        return EmbedResult(vectors, tokens, fresh.model, fresh.version, timings)

    async def _wait(self, ticket: Ticket, items: list[WorkItem], deadline: float,
                    disconnected: Callable[[], Awaitable[Any]] | None) -> None:
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        waiting = {ticket.future} if watcher is None else {ticket.future, watcher}
        timeout: float | None = max(0.0, deadline - time.monotonic())
        try:
            while not ticket.future.done():
                done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if ticket.future.done():
                    return
                if watcher is not None and watcher in done:
                    # The client went away: its queued items are dropped (and counted) before they run.
                    ticket.cancelled = ticket.closed = True
                    self.queue.wake()
                    raise ClientGone
                # The deadline passed. A busy worker would notice only after its batch; answer now, and take
                # the items still queued out (under the queue's lock) so they are never computed.
                if self.queue.remove(items) and not ticket.closed:
                    self.metrics.queue_depth.set(len(self.queue))
                    self._expire(ticket)
                    return
                timeout = None  # nothing of it is queued any more: it is running, its answer is coming
        finally:
            if watcher is not None:
                watcher.cancel()

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.set(self.in_flight)

    def _leave(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()

    def _expire(self, ticket: Ticket) -> None:
        """Answer 504: the deadline passed while queued (seen by the waiter or by the worker, whichever first)."""
        self.metrics.rejected.labels("deadline").inc()
        ticket.error = EngineError(504, "the request's deadline passed while it was queued",
                                   "deadline_exceeded", "deadline")
        ticket.closed = True

    def _input_error(self, exc: InputError) -> EngineError:
        reason = "too_long" if exc.code in ("context_length_exceeded", "too_many_tokens",
                                            "text_too_long") else "invalid"
        self.metrics.rejected.labels(reason).inc()
        return EngineError(422, exc.message, exc.code, reason, param=None if exc.index is None
                           else str(exc.index))

    def _not_ready(self, exc: ModelNotReady) -> EngineError:
        self.metrics.rejected.labels("not_ready").inc()
        detail = f": {exc.reason}" if exc.reason else ""
        return EngineError(503, f"the model is not ready ({exc.state}{detail})", f"model_{exc.state}",
                           "not_ready", retry_after=5 if exc.state == "failed" else 1)

    # -- the worker side (its own thread) --------------------------------------------------------------

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
                    self._resolve(tickets_of([*decision.batch, *decision.expired]),
                                  EngineError(500, "inference failed for this batch", "inference_error"))
                decision = None
        except BaseException as exc:  # the loop must never die silently: readiness reports it
            self.worker_error = f"{type(exc).__name__}: {exc}"
            self.metrics.worker_alive.set(0)
            log.critical("inference worker died", exc_info=True)
            err = EngineError(503, "the inference worker stopped", "worker_dead", "not_ready", retry_after=5)
            # The batch in hand as well as the queue: none of their requests may wait for ever.
            in_hand = [] if decision is None else [*decision.batch, *decision.expired]
            self._resolve(tickets_of([*in_hand, *self.queue.drain_all()]), err)
            raise

    def _handle(self, decision: Decision) -> None:
        done: list[Ticket] = []
        for item in decision.expired:
            t = item.ticket
            if not t.closed:
                self._expire(t)
                done.append(t)
        for item in decision.dropped:
            t = item.ticket
            if t.cancelled and t.remaining > 0:
                self.metrics.rejected.labels("disconnected").inc()
                t.remaining = 0
        if decision.batch:
            done.extend(self._run_batch(decision.batch))
        self.metrics.queue_depth.set(len(self.queue))
        self._finish(done)
        if self.memory_guard is not None and decision.batch:
            self.memory_guard.tick(len({id(i.ticket) for i in decision.batch}))

    def _run_batch(self, batch: list[WorkItem]) -> list[Ticket]:
        slot: ModelSlot = batch[0].group  # type: ignore[assignment]
        slot.acquire()
        started = time.monotonic()
        timing = [0.0, 0.0]
        try:
            results = self._infer_split(slot, batch, timing)
        finally:
            slot.release()
        infer_s, post_s = timing
        n = len(batch)
        longest = max(it.tokens for it in batch)
        version = slot.version
        m = self.metrics
        m.batch_size.labels(version).observe(n)
        m.batch_tokens.labels(version).observe(longest * n)
        m.inference_duration.labels(version).observe(infer_s)
        m.postprocess_duration.labels(version).observe(post_s)
        self.batches_run += 1
        batch_log.info("batch", extra={"batch_size": n, "batch_tokens": longest * n,
                                       "real_tokens": sum(it.tokens for it in batch),
                                       "inference_ms": round(infer_s * 1e3, 3),
                                       "postprocess_ms": round(post_s * 1e3, 3),
                                       "duration_ms": round((time.monotonic() - started) * 1e3, 3),
                                       "version": version})
        done = []
        key = self.batches_run
        for item, result in zip(batch, results, strict=True):
            t = item.ticket
            queued = started - item.enqueued
            m.queue_duration.labels(version).observe(queued)
            if t.closed:
                continue
            t.queue_s = max(t.queue_s, queued)
            if key not in t._batches:
                t._batches.add(key)
                t.infer_s += infer_s
                t.post_s += post_s
                t.batch_size = max(t.batch_size, n)
            if isinstance(result, EngineError):
                t.error, t.closed = result, True
                done.append(t)
                continue
            t.results[item.index] = result
            t.remaining -= 1
            if t.remaining == 0:
                t.closed = True
                done.append(t)
        return done

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
                self.metrics.rejected.labels("oom").inc()
                return [EngineError(507, "out of memory computing this input even alone; send a shorter "
                                    "text or retry later", "out_of_memory", "oom")]
            log.exception("batch of %d failed", len(items))
            return [EngineError(500, "inference failed for this batch", "inference_error")] * len(items)

    def _finish(self, tickets: list[Ticket]) -> None:
        if tickets and self._loop is not None:
            self._loop.call_soon_threadsafe(settle, tickets)

    def _resolve(self, tickets: list[Ticket], err: EngineError) -> None:
        for t in tickets:
            if not t.closed:
                t.error, t.closed = err, True
        self._finish(tickets)
