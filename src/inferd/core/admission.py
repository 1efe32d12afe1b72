"""Admission: the event loop's side of the engine, from a request's inputs to its answer.

It takes a request validated when it was built (core/request.py), checks what depends on the model, routes
it to a model slot (loading it first in lazy mode), answers what
the result cache holds, tokenises the rest (cheap, and overlapping the running batch: the pipelining),
queues one item per input and waits on one future per request, refusing at the deadline, dropping
the queued work of a client that left, and refusing new work while draining. It composes the units of a
request's other parts: the result cache (core/cache.py ResultCache.answer), the int8 calibration
(core/calibration.py), the shadow mirror (core/shadow_mirror.py) and where inputs are tokenised
(core/tokenizing.py). The worker thread reports
outcomes (core/outcomes.py) through ``deliver``; they are applied here, on the loop, the only writer of a
request's outcome.

A request holds its slot until it is answered, and takes its items out of the queue before it lets go:
with the claim a batch takes as the queue hands it out, no slot can be freed under a batch about to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from inferd.core.batcher import BatchQueue, QueueClosed, QueueFull
from inferd.core.calibration import calibration
from inferd.core.errors import ClientGone, EngineError, Kind, ModelNotReady, deadline_passed
from inferd.core.outcomes import Failure, Outcome, TaskResult, Ticket, WorkItem
from inferd.core.preprocess import InputError
from inferd.core.prompts import prompt_text
from inferd.core.registry import ModelRegistry, Resolved, ServedModel
from inferd.core.request import InferenceRequest, input_refusal
from inferd.core.scheduler import BACKGROUND
from inferd.core.shadow_mirror import ShadowMirror
from inferd.core.slots import ModelSlot
from inferd.core.tasks.embedding_task import DEFAULT_OUTPUTS
from inferd.core.tasks.kinds import task_of
from inferd.core.tenant import Tenant
from inferd.core.text_options import PLAIN_INPUTS, InputOptions
from inferd.core.tokenizing import Tokenizing, chars
from inferd.settings import Settings
from inferd.utils import tracing
from inferd.utils.metrics import Metrics

Disconnected = Callable[[], Awaitable[Any]]


# Special tokens one input may add beyond its characters' tokens (a pair's [CLS] query [SEP] document [SEP]).
_SPECIAL_TOKENS = 3


def token_estimate(inputs: list[Any], options: InputOptions, window: int | None) -> int:
    """The tokens ``inputs`` are reserved from a tenant's budget before they are tokenised (core/tenant.py
    reserve): a token per character plus the special tokens, at most the model's window per input (a longer one
    is cut, or refused uncharged) and a text's own ``max_tokens`` (its ``options``). A bound for WordPiece (BERT,
    MiniLM: every token but the specials spans a character or more), so such a request is never refused once
    tokenised; a byte-level tokenizer can exceed it, and the settling makes the budget hold all the same. It runs up
    to about four times a short English text's count, which only requests tokenising at once pay (a reservation is
    settled as the request is queued, and a request under INLINE_TOKENIZE_CHARS, core/tokenizing.py, is tokenised
    and queued in one step)."""
    total = 0
    for item, chosen in zip(inputs, options.per_text(len(inputs)), strict=True):
        cap = window
        if chosen.max_tokens is not None:
            cap = chosen.max_tokens if cap is None else min(cap, chosen.max_tokens)
        estimate = chars(item) + _SPECIAL_TOKENS
        total += estimate if cap is None else min(estimate, cap)
    return total


def not_ready(exc: ModelNotReady, model: str | None = None) -> EngineError:
    # The state only: a failed load's reason names filesystem paths (it is in the log and /admin/models).
    kind = Kind.MODEL_FAILED if exc.state == "failed" else Kind.NOT_READY
    which = f"model {model!r}" if model else "the model"
    return EngineError(kind, f"{which} is not ready ({exc.state})", f"model_{exc.state}")


class Admission:
    def __init__(self, registry: ModelRegistry, settings: Settings, metrics: Metrics, queue: BatchQueue,
                 worker_alive: Callable[[], bool]) -> None:
        self.registry = registry
        self.settings = settings
        self.metrics = metrics
        self.queue = queue
        self.worker_alive = worker_alive
        self.in_flight = 0
        # Requests that run as several (a long document's waves, core/pieces.py), counted from their acceptance to
        # their answer: between two waves none of theirs is in flight, and a drain must wait for them all the same.
        self.running_whole = 0
        self.draining = False
        # The drain's time ran out: from now on nothing runs, not even the next wave of an accepted document.
        self.drain_expired = False
        # A drain ran out of time with work still running: stopping need not wait for the worker.
        self.abandoned = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self.tokenizing = Tokenizing(settings.limits.preprocess_concurrency)
        # Accepted requests not yet answered (queued or running): a drain that times out answers them all.
        self._open: set[Ticket] = set()
        self.shadow_mirror = ShadowMirror(queue, metrics, self.tokenizing)

    def bind(self) -> None:
        """On the event loop that will run the requests (at start)."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()

    def on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """From any thread: run ``fn`` on the event loop (a no-op once the loop is gone)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def deliver(self, outcome: Outcome) -> None:
        """From the worker thread: an outcome, applied on the loop."""
        self.on_loop(outcome.apply)

    async def drain(self, timeout: float) -> bool:
        """Refuse new work, wait for what was accepted; past the timeout answer the rest (draining)."""
        self.draining = True
        self.shadow_mirror.cancel()  # shadow work is shed first
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            self.drain_expired = True
            # Queued and running alike: a request still unanswered now gets its refusal rather than hang.
            stuck = {id(i.ticket): i.ticket for i in self.queue.drain_all()}
            stuck.update((id(t), t) for t in self._open)
            self.abandoned = any(not t.closed for t in stuck.values())
            Failure(list(stuck.values()), EngineError(
                Kind.DRAINING, "the server is shutting down; retry on another instance")).apply()
            return False

    @contextlib.contextmanager
    def whole_request(self) -> Iterator[None]:
        """A request that runs as several (a long document's waves): refused if the server is draining now, else
        accepted for its whole life, so a drain waits for its last wave rather than refusing the next one (its
        pieces already computed would be thrown away, and the client answered 503 with drain time to spare)."""
        if self.draining:
            raise EngineError(Kind.DRAINING, "the server is draining; retry on another instance")
        self.running_whole += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.running_whole -= 1
            self._settle()

    # -- one request -----------------------------------------------------------------------------------

    async def serve_inputs(self, request: InferenceRequest, disconnected: Disconnected | None = None, *,
                           admitted: bool = False, resolved: Resolved | None = None,
                           part_of_accepted: bool = False) -> TaskResult:
        """One request's inputs (texts, or (query, document) pairs) through the model, one result each.

        The request was validated when it was built (core/request.py); here only what depends on the model:
        its task (``request.task``), its priority bound and queue, the size it allows (``dimensions``) and its
        prompts, all read from the description of the slot picked to run the request, before any work.
        ``admitted``: the request's tenant was admitted by the caller, for the whole of a document's pieces;
        ``resolved``: the request's model as the engine resolved it (None: resolved here); ``part_of_accepted``: a
        part of a request accepted before a drain began (``whole_request``), which runs until the drain expires.
        """
        if self.draining and (not part_of_accepted or self.drain_expired):
            raise EngineError(Kind.DRAINING, "the server is draining; retry on another instance")
        if not self.worker_alive():
            # The cause (an exception's text) is for the log and /admin/models, not for every client.
            raise EngineError(Kind.WORKER_DEAD, "the inference worker is not running")
        served, pin = resolved or self.registry.resolve(request.model, request.task, version=request.version,
                                                        allowed=request.allowed_models)
        try:
            return await self._serve_on_model(served, pin, request, disconnected, admitted)
        except EngineError as exc:
            exc.model = served.name  # the request metrics' label: the model that refused it
            raise

    async def _serve_on_model(self, served: ServedModel, pin: str | None, request: InferenceRequest,
                         disconnected: Disconnected | None, admitted_before: bool = False) -> TaskResult:
        batching, priority, timeout_ms = served.settings.batching, request.priority, request.timeout_ms
        if priority > batching.max_priority:
            raise EngineError(Kind.INVALID_INPUT, f"priority {priority} is above the highest allowed here, "
                              f"{batching.max_priority} (batching.max_priority)", "priority_not_allowed",
                              field="priority")
        inputs: list[Any] = list(request.inputs)
        # The model's own bound, read from the model resolved (its lane holds the same: both are set together, at
        # start and by a SIGHUP, on the loop), not looked up again under the queue's lock.
        max_queue = batching.max_queue
        if len(inputs) > max_queue:
            # "Overloaded, retry" would promise a retry that can never fit in the queue.
            raise EngineError(Kind.INVALID_INPUT, f"{len(inputs)} texts given; at most {max_queue} "
                              "(batching.max_queue) per request", "too_many_items")
        tenant, admitted = request.tenant, None
        if tenant is not None:
            tenant.allow(served.name)  # before the route: a model it may not call is not loaded for it (lazy mode)
        slot = await self._route(served, request.routing_key, pin)
        self._enter()
        try:
            if tenant is not None and not admitted_before:
                # The tenant's own rules on the model chosen (core/tenant.py); its place is given back below. A
                # document's pieces (core/pieces.py) come admitted once for the whole request: their tokens are
                # charged here all the same, their waves are not each a request of the tenant's.
                priority, admitted = tenant.admit(served.name, priority), tenant
            task = request.task
            if task is not None and slot.task != task:
                raise EngineError(Kind.MODEL_NOT_FOUND, f"model {served.name!r} is a {slot.task} model, not a "
                                  f"{task} model", field="model")
            # The request's task options (its vectors' size, its outputs) this load cannot give: known before any
            # work, so refused now rather than computed in vain.
            refusal = task_of(slot.task).refusal(slot.description, request.dimensions, request.outputs)
            if refusal is not None:
                raise refusal
            # The outputs asked, which the texts' options carry to the handler and into their cache keys
            # (core/outputs.py asked), and the prompt of the slot that runs (a canary's own), prepended to each text
            # before tokenisation: the options are chosen once for the request, the texts stay plain strings.
            prompt = "" if request.prompt is None else prompt_text(slot.description, request.prompt,
                                                                   served.settings.model.input_type_prompts)
            options = request.text_options.chosen(None if request.outputs == DEFAULT_OUTPUTS else request.outputs,
                                                  prompt)
            if prompt:
                inputs = [prompt + t for t in inputs]

            def compute(texts: list[Any], chosen: InputOptions) -> Awaitable[TaskResult]:
                return self._serve_on_slot(served, slot, texts, chosen, tenant, priority, timeout_ms, disconnected)

            if served.cache is None:
                result = await compute(inputs, options)
            else:
                # This very slot's entries, and this tenant's (core/cache.py).
                scope = None if tenant is None else tenant.name
                result = await served.cache.answer(slot.load_id, slot.description, inputs, options, scope, compute)
            if request.calibrate:
                result.calibration = await calibration(
                    served, slot,
                    # The load's, measured once for every caller: no tenant's budget or share.
                    lambda on, texts: self._serve_on_slot(served, on, texts, PLAIN_INPUTS, None, priority, timeout_ms,
                                                          None))
            # While the slot is held: its version's series cannot have been removed (slot freed) under us.
            self.metrics.version_requests.labels(served.name, slot.version).inc()
            self.metrics.task_items.labels(served.name, slot.task).inc(len(inputs))
            if slot.description.outputs is not None:
                for kind in request.outputs:
                    self.metrics.output_items.labels(served.name, kind).inc(len(inputs))
            if (served.manager.shadow is not None and slot is served.manager.active and not self.draining
                    and self._loop is not None):
                self.shadow_mirror.mirror(served, request.routing_key, inputs, options, result)
            return result
        finally:
            if admitted is not None:
                admitted.leave()
            slot.release()
            self._leave()

    @contextlib.asynccontextmanager
    async def hold(self, model: str | None = None, task: str | None = None) -> AsyncIterator[ModelSlot]:
        """A slot of the model ``model`` names (None: ``task``'s default), held while the block runs, for work
        that is not a request's inputs through the queue (TEI's /tokenize shows the running load's tokenizer)."""
        name, at, version = (model or "").partition("@")
        served, pin = self.registry.resolve(name or None, task, version=version if at else None)
        slot = await self._route(served, None, pin)
        try:
            yield slot
        finally:
            slot.release()

    async def _route(self, served: ServedModel, routing_key: str | None, pin: str | None) -> ModelSlot:
        """The slot this request runs on, with a reference taken; lazy mode loads the model first."""
        try:
            if served.settings.model.load_mode == "lazy":
                await served.manager.ensure_loaded()
            return served.manager.pick(routing_key, pin)
        except ModelNotReady as exc:
            raise not_ready(exc, served.name) from None

    async def _serve_on_slot(self, served: ServedModel, slot: ModelSlot, inputs: list[Any], options: InputOptions,
                      tenant: Tenant | None, priority: int, timeout_ms: float | None,
                      disconnected: Disconnected | None) -> TaskResult:
        # Reserved from the tenant's budget before tokenising, so requests tokenising at once see each other's
        # (core/tenant.py); settled against the real count as it is queued, given back if it never is.
        window = slot.description.max_seq_length
        reserved = 0 if tenant is None else tenant.reserve(token_estimate(inputs, options, window))
        version, name, batching = slot.version, served.name, served.settings.batching
        t0 = time.perf_counter()
        try:
            try:
                with tracing.span("tokenize"):
                    encoded = await self.tokenizing.encode(slot, inputs, options, background=priority <= BACKGROUND)
            except InputError as exc:
                raise input_refusal(exc) from None
            pre_s = time.perf_counter() - t0
            self.metrics.preprocess_duration.labels(name, version).observe(pre_s)
            if batching.oversize == "reject":
                for i, enc in enumerate(encoded):
                    if enc.tokens > batching.max_batch_tokens:
                        raise EngineError(Kind.TOO_LONG, f"has {enc.tokens} tokens, more than "
                                          f"batching.max_batch_tokens ({batching.max_batch_tokens})",
                                          "too_many_tokens", index=i)
        except BaseException:  # refused, failed or cancelled (the client left) before it was queued
            if tenant is not None:
                tenant.release(reserved)
            raise
        assert self._loop is not None
        # tracing.queued(): the request's queue and inference spans, made as its outcome is applied.
        ticket = Ticket(self._loop.create_future(), len(encoded), tracing.queued())
        now = time.monotonic()
        deadline = now + (timeout_ms or batching.default_timeout_ms) / 1000.0
        tokens = sum(e.tokens for e in encoded)
        # A tenant's work is charged the tokens the model will run (its reservation settled, or refused if it ran
        # past it into a spent budget), and queued at its priority lowered by how far ahead of its share it is
        # (core/tenant.py). ``done`` settles the charge once it leaves the queue.
        rank = priority if tenant is None else tenant.queue(name, tokens, now, priority, batching.ageing_ms / 1e3,
                                                            reserved)
        # A fractional priority: the batcher adds waiting time to it (ageing), which is all a rank needs.
        items = [WorkItem(ticket, i, enc, enc.tokens, rank, now, deadline, self.queue.next_seq(), slot)  # type: ignore[arg-type]
                 for i, enc in enumerate(encoded)]
        try:
            self.queue.put(items, name)
        except (QueueFull, QueueClosed) as exc:
            if tenant is not None:
                tenant.done(name, tokens, ran=False)  # refused: not charged
            if isinstance(exc, QueueClosed):
                raise EngineError(Kind.DRAINING, "the server is shutting down") from None
            raise EngineError(Kind.OVERLOADED, f"the request queue of model {name!r} is full; retry "
                              "shortly") from None
        depth = self.metrics.queue_depth.labels(name)
        depth.set(self.queue.depth(name))
        self._open.add(ticket)
        try:
            await self._wait(ticket, items, deadline, disconnected, name)
        finally:
            self._open.discard(ticket)
            if ticket.remaining:
                # Answered early (an error, the deadline) or abandoned: the items still queued leave the queue
                # before the caller lets go of the slot, so no batch can be handed out on a slot being freed.
                ticket.close()
                if self.queue.remove(items):
                    depth.set(self.queue.depth(name))
            if tenant is not None:
                tenant.done(name, tokens, ticket.error is None and not ticket.remaining, ticket.infer_s,
                            ticket.batch_size, len(encoded))
        if ticket.error is not None:
            raise ticket.error
        return TaskResult(
            outputs=ticket.results, tokens=[e.tokens for e in encoded], description=slot.description,
            timings={"preprocess_ms": pre_s * 1e3, "queue_ms": ticket.queue_s * 1e3,
                     "inference_ms": ticket.infer_s * 1e3, "postprocess_ms": ticket.post_s * 1e3,
                     "batch_size": ticket.batch_size, "items": len(encoded)})

    async def _wait(self, ticket: Ticket, items: list[WorkItem], deadline: float,
                    disconnected: Disconnected | None, lane: str) -> None:
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
                        self.metrics.queue_depth.labels(lane).set(self.queue.depth(lane))
                    raise ClientGone
                # The deadline passed. A busy worker would notice only after its batch; answer now, and take
                # the items still queued out (under the queue's lock) so they are never computed.
                if self.queue.remove(items) and not ticket.closed:
                    self.metrics.queue_depth.labels(lane).set(self.queue.depth(lane))
                    ticket.close(deadline_passed())
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
        self._settle()

    def _settle(self) -> None:
        """Idle (what a drain waits for) once no request and no document's waves are running."""
        if self.in_flight == 0 and self.running_whole == 0:
            self._idle.set()
