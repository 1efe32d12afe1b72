"""The inference engine: admits requests, splits them into items, and runs batches on a worker thread.

The event loop only tokenises (cheap, and overlapping the running batch: the pipelining) and waits on one
future per request. The worker thread takes batches from the queue, runs the handler under
``torch.inference_mode``, and hands what it computed back to the loop with one call per batch; the loop
is the only writer of a request's outcome (core/work.py).

A batch holds its model slot from the moment the queue hands it out (the claim is taken under the queue's
lock), and a request that leaves takes its items out of the queue before it lets go of its slot: so a
slot can never be freed under a batch about to run. Slots are freed on the worker thread (``reaper``),
never on the event loop: freeing closes the handler and empties the device cache.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
import torch

from inferd.config import Settings
from inferd.core.batcher import BatchQueue, Decision, Policy, QueueClosed, QueueFull
from inferd.core.cache import EmbeddingCache
from inferd.core.model_loader import ModelManager, ModelNotReady, ModelSlot
from inferd.core.preprocess import InputError, check_texts
from inferd.core.work import BatchReport, ClientGone, EmbedResult, EngineError, TaskResult, Ticket, WorkItem, tickets_of
from inferd.utils.metrics import Metrics

__all__ = ["ClientGone", "EmbedResult", "EngineError", "InferenceEngine", "TaskResult"]

log = logging.getLogger(__name__)
batch_log = logging.getLogger("inferd.batch")

# Below this many characters a request is tokenised on the event loop; above, in a thread.
_INLINE_TOKENIZE_CHARS = 4096


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


def _chars(item: Any) -> int:
    return len(item) if isinstance(item, str) else sum(map(len, item))


def _claim(batch: list[WorkItem]) -> None:
    # Under the queue's lock, as the batch is chosen: its slot cannot be freed between take and run.
    slot: ModelSlot = batch[0].group  # type: ignore[assignment]
    slot.acquire()


class InferenceEngine:
    def __init__(self, manager: ModelManager, settings: Settings, metrics: Metrics,
                 memory_guard: Any = None) -> None:
        self.manager = manager
        self.settings = settings
        self.metrics = metrics
        self.memory_guard = memory_guard
        self.policy = Policy.from_settings(settings.batching)
        self.queue = BatchQueue(self.policy, settings.batching.max_queue, claim=_claim)
        # Keyed by the slot's load, not its version string: the cache answers only for the model it serves.
        self.cache = (EmbeddingCache(settings.cache.max_entries, metrics) if settings.cache.max_entries
                      else None)
        self.in_flight = 0
        self.draining = False
        self.worker_error: str | None = None
        self.batches_run = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle = asyncio.Event()
        # Long texts are tokenised in the thread pool; this many requests at a time, the rest wait their turn
        # (so a few senders of huge texts cannot keep every request in preprocessing at once).
        self._preprocessing = asyncio.Semaphore(settings.limits.preprocess_concurrency)
        # Accepted requests not yet answered (queued or running): a drain that times out answers them all.
        self._open: set[Ticket] = set()
        self._abandoned = False
        manager.reaper = self._on_worker
        manager.on_freed = self._slot_freed

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
        if self._thread is None or not self._thread.is_alive():
            self._run_chores(self.queue.take_chores())  # frees posted as the worker stopped

    def _on_worker(self, chore: Callable[[], None]) -> None:
        """Run ``chore`` on the worker thread (a slot's free); here when this is the worker or there is none."""
        thread = self._thread
        if thread is None or not thread.is_alive() or threading.current_thread() is thread:
            self._run_chores([chore])
        else:
            self.queue.post(chore)

    def _slot_freed(self, slot: ModelSlot, last_of_version: bool) -> None:
        if self.cache is not None:
            self._to_loop(self.cache.forget, slot.load_id)  # the cache lives on the loop
        if last_of_version:
            # Retired versions' series would otherwise pile up with every reload.
            self.metrics.forget_version(slot.version)

    @staticmethod
    def _run_chores(chores: list[Callable[[], None]]) -> None:
        for chore in chores:
            try:
                chore()
            except Exception:
                log.exception("freeing a model failed")

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
            self._fail(list(stuck.values()), err)
            return False

    # -- the request side (event loop) -----------------------------------------------------------------

    async def run(self, texts: list[Any], *, priority: int = 0, timeout_ms: float | None = None,
                  routing_key: str | None = None, model: str | None = None, task: str | None = None,
                  admit: Callable[[Mapping[str, Any]], None] | None = None,
                  disconnected: Callable[[], Awaitable[Any]] | None = None) -> TaskResult:
        """One request's inputs (texts, or (query, document) pairs) through the model, one result each.

        ``task`` refuses a model of another task (404); ``admit`` sees the picked model's description
        before any work and may refuse the request (an EngineError) for what the model is.
        """
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise EngineError(503, "the server is draining; retry on another instance", "draining",
                              "draining", retry_after=1)
        if not self.alive:
            # The cause (an exception's text) is for the log and /admin/models, not for every client.
            raise EngineError(503, "the inference worker is not running", "worker_dead", "not_ready",
                              retry_after=5)
        texts = self.precheck(texts)
        ceiling = self.settings.batching.max_priority
        if priority > ceiling:
            self.metrics.rejected.labels("invalid").inc()
            raise EngineError(422, f"priority {priority} is above the highest allowed here, {ceiling} "
                              "(batching.max_priority)", "priority_not_allowed", "invalid", field="priority")
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
            if task is not None and slot.task != task:
                raise EngineError(404, f"this server serves the {slot.task} task, not {task}", "wrong_task")
            if admit is not None:
                try:
                    admit(slot.info)  # known before any work: refuse now rather than compute in vain
                except EngineError as exc:
                    self.metrics.rejected.labels(exc.reason or "invalid").inc()
                    raise
            if self.cache is None:
                result = await self._embed_on(slot, texts, priority, timeout_ms, disconnected)
            else:
                result = await self._embed_cached(slot, texts, priority, timeout_ms, disconnected)
            # While the slot is held: its version's series cannot have been removed (slot freed) under us.
            self.metrics.version_requests.labels(slot.version).inc()
            self.metrics.task_items.labels(slot.task).inc(len(texts))
            return result
        finally:
            slot.release()
            self._leave()

    embed = run  # the name the embedding routes and tests know

    def precheck(self, texts: Any) -> list[Any]:
        """The checks that need no model: types, emptiness, counts, lengths (422 naming the text).

        Pairs (query, document) are checked by their documents, each one item (the index names it); their
        query is the same for all and checked by the route. The HTTP layer runs these checks too, while it
        parses a body, so a huge refused body never outlives parsing.
        """
        limits = self.settings.limits
        try:
            if not isinstance(texts, list):
                raise InputError(None, f"must be a list of strings, not {type(texts).__name__}", "invalid_type")
            if texts and isinstance(texts[0], tuple):
                check_texts([d for _, d in texts], limits.max_items_per_request, limits.max_chars_per_text)
                checked: list[Any] = texts
            else:
                checked = check_texts(texts, limits.max_items_per_request, limits.max_chars_per_text)
            if len(checked) > self.queue.max_queue:
                # 503 + Retry-After would promise a retry that can never fit in the queue.
                raise InputError(None, f"{len(checked)} texts given; at most {self.queue.max_queue} "
                                 "(batching.max_queue) per request", "too_many_items")
        except InputError as exc:
            raise self._input_error(exc) from None
        return checked

    async def _preprocess(self, slot: ModelSlot, texts: list[Any]) -> list[Any]:
        if sum(map(_chars, texts)) <= _INLINE_TOKENIZE_CHARS:
            return slot.handler.preprocess(texts)
        async with self._preprocessing:
            return await asyncio.to_thread(slot.handler.preprocess, texts)

    async def _embed_on(self, slot: ModelSlot, texts: list[str], priority: int, timeout_ms: float | None,
                        disconnected: Callable[[], Awaitable[Any]] | None) -> TaskResult:
        t0 = time.perf_counter()
        try:
            encoded = await self._preprocess(slot, texts)
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
            if ticket.remaining:
                # Answered early (an error, the deadline) or abandoned: the items still queued leave the queue
                # before the caller lets go of the slot, so no batch can be handed out on a slot being freed.
                ticket.close()
                if self.queue.remove(items):
                    self.metrics.queue_depth.set(len(self.queue))
        if ticket.error is not None:
            raise ticket.error
        return TaskResult(
            outputs=ticket.results, tokens=[e.tokens for e in encoded], model=slot.spec.name, version=version,
            timings={"preprocess_ms": pre_s * 1e3, "queue_ms": ticket.queue_s * 1e3,
                     "inference_ms": ticket.infer_s * 1e3, "postprocess_ms": ticket.post_s * 1e3,
                     "batch_size": ticket.batch_size, "items": len(encoded)})

    async def _embed_cached(self, slot: ModelSlot, texts: list[str], priority: int, timeout_ms: float | None,
                            disconnected: Callable[[], Awaitable[Any]] | None) -> TaskResult:
        """Answer what the cache holds for this very slot; queue only the rest, then remember it."""
        assert self.cache is not None
        # A pair is keyed by both its texts; one slot serves one task, so a pair's key never meets a text's.
        keys = [t if isinstance(t, str) else orjson.dumps(t).decode() for t in texts]
        hits = self.cache.lookup(slot.load_id, keys)
        todo = [i for i in range(len(texts)) if i not in hits]
        fresh = TaskResult([], [], slot.spec.name, slot.version, {"batch_size": 0, "items": 0})
        if todo:
            try:
                fresh = await self._embed_on(slot, [texts[i] for i in todo], priority, timeout_ms, disconnected)
            except EngineError as exc:
                if exc.param is not None:  # an index into the texts sent on: map it back to the request's
                    exc.param = str(todo[int(exc.param)])
                raise
            self.cache.store(slot.load_id, [keys[i] for i in todo], fresh.outputs, fresh.tokens)
        outputs: list[Any] = [None] * len(texts)
        tokens = [0] * len(texts)
        for i, (output, count) in hits.items():
            outputs[i], tokens[i] = output, count
        for j, i in enumerate(todo):
            outputs[i], tokens[i] = fresh.outputs[j], fresh.tokens[j]
        timings = {**fresh.timings, "items": len(texts), "cache_hits": len(hits)}
        return TaskResult(outputs, tokens, fresh.model, fresh.version, timings)

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
                    ticket.close()
                    if self.queue.remove(items):
                        self.metrics.rejected.labels("disconnected").inc()
                        self.metrics.queue_depth.set(len(self.queue))
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
        """On the loop: answer 504, the deadline passed while queued (seen by the waiter or by the worker)."""
        if ticket.close(EngineError(504, "the request's deadline passed while it was queued",
                                    "deadline_exceeded", "deadline")):
            self.metrics.rejected.labels("deadline").inc()

    def _expire_all(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            self._expire(t)

    def _fail(self, tickets: list[Ticket], err: EngineError) -> None:
        """On the loop: answer every ticket not yet answered with ``err``."""
        for t in tickets:
            t.close(err)

    def _input_error(self, exc: InputError) -> EngineError:
        reason = "too_long" if exc.code in ("context_length_exceeded", "too_many_tokens",
                                            "text_too_long") else "invalid"
        self.metrics.rejected.labels(reason).inc()
        return EngineError(422, exc.message, exc.code, reason, param=None if exc.index is None
                           else str(exc.index))

    def _not_ready(self, exc: ModelNotReady) -> EngineError:
        self.metrics.rejected.labels("not_ready").inc()
        # The state only: a failed load's reason names filesystem paths (it is in the log and /admin/models).
        return EngineError(503, f"the model is not ready ({exc.state})", f"model_{exc.state}",
                           "not_ready", retry_after=5 if exc.state == "failed" else 1)

    # -- the worker side (its own thread) --------------------------------------------------------------

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Hand an outcome to the event loop, its only writer."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

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
                    self._to_loop(self._fail, tickets_of([*decision.batch, *decision.expired]),
                                  EngineError(500, "inference failed for this batch", "inference_error"))
                decision = None
        except BaseException as exc:  # the loop must never die silently: readiness reports it
            self.worker_error = f"{type(exc).__name__}: {exc}"
            self.metrics.worker_alive.set(0)
            log.critical("inference worker died", exc_info=True)
            err = EngineError(503, "the inference worker stopped", "worker_dead", "not_ready", retry_after=5)
            # The batch in hand as well as the queue: none of their requests may wait for ever.
            in_hand = [] if decision is None else [*decision.batch, *decision.expired]
            self._to_loop(self._fail, tickets_of([*in_hand, *self.queue.drain_all()]), err)
            self._run_chores(self.queue.take_chores())
            raise

    def _handle(self, decision: Decision) -> None:
        expired = tickets_of(decision.expired)
        if expired:
            self._to_loop(self._expire_all, expired)
        if decision.batch:
            slot: ModelSlot = decision.batch[0].group  # type: ignore[assignment]
            try:
                report = self._run_batch(slot, decision.batch)
            finally:
                slot.release()  # the claim the queue took for this batch; a retired slot is freed here
            if report is not None:
                self._to_loop(report.apply)
        self.metrics.queue_depth.set(len(self.queue))
        self._run_chores(decision.chores)
        if self.memory_guard is not None and decision.batch:
            self.memory_guard.tick(len({id(i.ticket) for i in decision.batch}))

    def _run_batch(self, slot: ModelSlot, batch: list[WorkItem]) -> BatchReport | None:
        # Requests that left since the batch was chosen are not computed for.
        batch = [it for it in batch if not it.ticket.closed]
        if not batch:
            return None
        started = time.monotonic()
        if not slot.usable:
            # Cannot happen while requests keep their items' slot (see the module docstring); if it ever
            # does, refuse rather than run on a model that is being freed.
            log.error("a batch was handed out on a released model", extra={"version": slot.version})
            err = EngineError(503, "the model this request was routed to was unloaded; retry",
                              "model_unloaded", "not_ready", retry_after=1)
            return BatchReport(0, started, 0.0, 0.0, len(batch), [(it, err) for it in batch])
        timing = [0.0, 0.0]
        results = self._infer_split(slot, batch, timing)
        infer_s, post_s = timing
        n = len(batch)
        longest = max(it.tokens for it in batch)
        version = slot.version
        m = self.metrics
        m.batch_size.labels(version).observe(n)
        m.batch_tokens.labels(version).observe(longest * n)
        m.inference_duration.labels(version).observe(infer_s)
        m.postprocess_duration.labels(version).observe(post_s)
        for item in batch:
            m.queue_duration.labels(version).observe(started - item.enqueued)
        self.batches_run += 1
        batch_log.info("batch", extra={"batch_size": n, "batch_tokens": longest * n,
                                       "real_tokens": sum(it.tokens for it in batch),
                                       "inference_ms": round(infer_s * 1e3, 3),
                                       "postprocess_ms": round(post_s * 1e3, 3),
                                       "duration_ms": round((time.monotonic() - started) * 1e3, 3),
                                       "version": version})
        return BatchReport(self.batches_run, started, infer_s, post_s, n,
                           list(zip(batch, results, strict=True)))

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
