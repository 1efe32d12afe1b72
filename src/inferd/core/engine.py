"""The inference engine: admission on the event loop, batch workers (model instances) on threads, a queue between.

This module only wires them: the bounded queue (core/batcher.py) over the pure scheduler (core/scheduler.py), the
admission side (core/admission.py: the model's checks, route, cache, enqueue, wait, drain) and the workers
(core/workers.py, each a core/worker.py thread: run batches, split on out-of-memory, free slots). The workers hand
outcomes to admission, which applies them on the loop. ``InferenceEngine`` keeps the one surface the API, the CLI
and the tests use.

The engine builds the ModelManager too: a slot must be freed on the worker thread and its cache entries
forgotten on the loop, so the manager is handed those callbacks when it is built, not told them afterwards.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeAlias

from inferd.core.admission import Admission
from inferd.core.batcher import BatchQueue
from inferd.core.budgets import with_budgets
from inferd.core.cache import ResultCache
from inferd.core.errors import EngineError, ModelLoadError, ModelNotReady, ReloadInProgress
from inferd.core.instances import Instance
from inferd.core.loading import load_handler
from inferd.core.manager import ModelManager
from inferd.core.outcomes import TaskResult, WorkItem
from inferd.core.pieces import Documents
from inferd.core.registry import ModelRegistry, Resolved, ServedModel
from inferd.core.request import InferenceRequest, Limits
from inferd.core.scheduler import Policy
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler
from inferd.core.workers import Workers
from inferd.settings import ModelEntry, Settings
from inferd.utils.metrics import Metrics

log = logging.getLogger(__name__)

# Told every served slot after any model's change: (model name, role, slot) (the app publishes them as metrics).
OnModelsChange: TypeAlias = Callable[[list[tuple[str, str, ModelSlot]]], None]

# SIGHUP and a served model's ``model:`` keys. These rule its later changes, not what it loads: taken without a reload
# (the slot loader and the rollout read them when a change runs).
LIVE_KEYS = frozenset({"root", "allow_dimension_change", "load_timeout_s", "load_delay_s"})
# These rule its first load alone (when it runs, what its failure does), read once when the model is added: a model
# already served keeps them until a restart (start_only names them). Every other key is what the model loads: a change
# of one reloads it (and needs a new model.version).
START_KEYS = frozenset({"load_mode", "exit_on_load_failure"})


def _claim(batch: list[WorkItem]) -> None:
    # Under the queue's lock, as the batch is chosen: its slot cannot be freed between its hand-out and its pass.
    batch[0].slot.acquire()


class InferenceEngine:
    def __init__(self, settings: Settings, metrics: Metrics, memory_guard: Any = None, *,
                 loader: Callable[[ModelSpec], Handler] = load_handler, on_change: OnModelsChange | None = None,
                 on_lazy_failure: Callable[[str], None] | None = None) -> None:
        """``loader`` is every model's ModelManager's (core/manager.py); ``on_lazy_failure`` that of each model
        with ``exit_on_load_failure`` set."""
        # Every model's threads per instance resolved once (core/instances.py): the loads and the workers read them.
        settings = with_budgets(settings)
        self.settings = settings
        self.metrics = metrics
        self.memory_guard = memory_guard
        self._loader = loader
        self._on_change: OnModelsChange = on_change or (lambda slots: None)
        self._on_lazy_failure = on_lazy_failure
        # One lane per model (``_build``), each with its own rules; a model's instances take its lane's batches.
        self.queue = BatchQueue(claim=_claim)
        self.registry = ModelRegistry()
        for entry in settings.served():
            self.registry.add(self._build(entry, settings))
        self.admission = Admission(self.registry, settings, metrics, self.queue, worker_alive=lambda: self.alive)
        # Requests that ask for chunking: their documents' pieces go through admission as ordinary inputs.
        self.documents = Documents(self.admission, self.registry, settings.limits)
        # Each model's instances, and the shadow lanes' own (core/workers.py).
        self.worker = Workers(self.queue, metrics, memory_guard, deliver=self.admission.deliver,
                              device=settings.served()[0].model.device)
        for served in self.registry:
            self.worker.set_model(served.entry, served.entry.model.device)

    def _build(self, entry: ModelEntry, settings: Settings) -> ServedModel:
        view = settings.for_model(entry)
        manager = ModelManager(view, self._loader, on_change=lambda slots: self._changed(),
                               on_lazy_failure=self._on_lazy_failure if entry.model.exit_on_load_failure else None,
                               post_to_worker=self._call_on_worker,
                               on_freed=functools.partial(self._slot_freed, entry.name))
        policy = Policy.from_settings(entry.batching)
        # Keyed by the slot's load, not its version string: the cache answers only for the model it serves.
        cache = (ResultCache(entry.cache.max_entries, self.metrics, entry.name, entry.cache.max_bytes)
                 if entry.cache.max_entries else None)
        self.queue.add_lane(entry.name, policy, entry.batching.max_queue, entry.share)
        self.metrics.queue_depth.labels(entry.name).set(0)
        return ServedModel(entry, view, manager, policy, cache)

    @property
    def manager(self) -> ModelManager:
        """The default model's manager (a single-model server's only one)."""
        first = self.registry.first()
        assert first is not None, "a server serves at least one model"
        return first.manager

    def slots(self) -> list[tuple[str, str, ModelSlot]]:
        """Every served slot of every model: (model name, role, slot)."""
        return [(m.name, role, slot) for m in self.registry for role, slot in m.manager.slots()]

    def _changed(self) -> None:
        self._on_change(self.slots())

    # -- what the admin API shows of the workers ---------------------------------------------------------

    def queue_depth(self, model: str) -> int:
        """Work of ``model`` waiting in the queue."""
        return self.queue.depth(model)

    def instances(self, model: str) -> list[Instance]:
        """``model``'s workers (core/instances.py), each with its budget and what it has run."""
        return self.worker.instances(model)

    @property
    def shadow_instance(self) -> Instance:
        """The worker of every model's shadow lane."""
        return self.worker.shadow

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """On the event loop that will serve: admission binds to it, the worker thread starts."""
        self.admission.bind()
        self.worker.start()

    @property
    def alive(self) -> bool:
        return self.worker.alive

    @property
    def worker_error(self) -> str | None:
        return self.worker.error

    @property
    def batches_run(self) -> int:
        return self.worker.batches_run

    @property
    def draining(self) -> bool:
        return self.admission.draining

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def stop(self, timeout: float = 5.0) -> None:
        # After a timed-out drain a worker is stuck in a batch; waiting longer would only delay exit.
        self.worker.stop(0.1 if self.admission.abandoned else timeout)

    def close(self) -> None:
        """Every model's manager: nothing serves after this."""
        for served in self.registry:
            served.manager.close()

    async def drain(self, timeout: float) -> bool:
        """Refuse new work, wait for what was accepted; past the timeout answer the rest (draining)."""
        return await self.admission.drain(timeout)

    def _call_on_worker(self, call: Callable[[], None]) -> None:
        # A slot's free, on the worker thread (no slot is freed before the engine is built).
        self.worker.on_worker(call)

    def _slot_freed(self, model: str, slot: ModelSlot, last_of_version: bool) -> None:
        served = self.registry.get(model)
        if served is not None and served.cache is not None:
            self.admission.on_loop(served.cache.forget, slot.load_id)  # the cache lives on the loop
        if last_of_version:
            # Retired versions' series would otherwise pile up with every reload.
            self.metrics.forget_version(model, slot.version)

    # -- the list of models (SIGHUP) -------------------------------------------------------------------

    async def reconfigure(self, fresh: Settings) -> dict[str, str]:
        """Serve ``fresh``'s list of models: add the new ones (loaded as their load_mode says), remove the gone
        ones (their requests finish first), and change the rest as ``_update`` says. Each model's sections are
        fresh's; every other section stays the start's (``self.settings``: only a restart changes them). Returns
        each model's outcome: added, removed, reloaded, updated, unchanged, or why a change failed (conflict,
        not_ready, failed)."""
        outcomes: dict[str, str] = {}
        fresh = with_budgets(fresh)
        wanted = {e.name: e for e in fresh.served()}
        for served in list(self.registry):
            if served.name not in wanted:
                self.registry.remove(served.name)
                self.queue.retire_lane(served.name)
                served.manager.close()  # its slots go once their last requests let go
                self.worker.remove_model(served.name)
                self.metrics.queue_depth.remove(served.name)
                log.info("model removed", extra={"model": served.name})
                outcomes[served.name] = "removed"
        for name, entry in wanted.items():
            served = self.registry.get(name)
            if served is None:
                served = self._build(entry, self.settings)
                self.registry.add(served)
                outcomes[name] = "added"
                log.info("model added", extra={"model": name})
                if entry.model.load_mode != "lazy":
                    try:
                        await asyncio.to_thread(served.manager.load_initial)
                    except ModelLoadError:
                        outcomes[name] = "failed"  # it stays listed, failed, as a failed start would
                self._changed()
                continue
            outcomes[name] = await self._update(served, entry)
        for served in self.registry:  # instances added or removed anywhere split the cores anew
            self.worker.set_model(served.entry, served.entry.model.device)
        return outcomes

    def start_only(self, fresh: Settings) -> list[str]:
        """The keys of served models that ``fresh`` changes and only a restart applies (START_KEYS), by name."""
        names = []
        for entry in fresh.served():
            served = self.registry.get(entry.name)
            for key in sorted(START_KEYS):
                if served is not None and getattr(entry.model, key) != getattr(served.entry.model, key):
                    names.append(f"models.{entry.name}.{key}" if fresh.models else f"model.{key}")
        return names

    async def _update(self, served: ServedModel, entry: ModelEntry) -> str:
        """A served model takes ``entry``, part by part: its model (reloaded when what it loads changed, else its
        rules of change taken), then its canary (installed, replaced, reweighted or dropped), then its batching,
        cache and entry keys. A part that fails stays as it was, and is tried again by the next SIGHUP; the canary
        waits for a failed model (it is measured against the new one); the rules apply whatever the models do."""
        old = served.entry
        entry = entry.model_copy(update={"model": entry.model.model_copy(
            update={k: getattr(old.model, k) for k in START_KEYS})})
        taken, loaded, failure = old, False, None
        if entry.model != old.model:
            if entry.model.model_dump(exclude=set(LIVE_KEYS)) != old.model.model_dump(exclude=set(LIVE_KEYS)):
                view = self.settings.for_model(entry)
                failure = await self._change(served, "", lambda: served.manager.reload_from_settings(view))
                loaded = failure is None
            if failure is None:
                taken = taken.model_copy(update={"model": entry.model})
        if failure is None and entry.canary != old.canary:
            view = self.settings.for_model(taken.model_copy(update={"canary": entry.canary}))
            before = served.manager.canary
            failure = await self._change(served, " (its canary)", lambda: served.manager.canary_from_settings(view))
            if failure is None:
                taken = taken.model_copy(update={"canary": entry.canary})
                loaded = loaded or served.manager.canary not in (None, before)
        taken = entry.model_copy(update={"model": taken.model, "canary": taken.canary})
        if taken != old:
            if taken.cache != old.cache:
                served.cache = (ResultCache(taken.cache.max_entries, self.metrics, taken.name, taken.cache.max_bytes)
                                if taken.cache.max_entries else None)
            served.entry = taken
            served.settings = self.settings.for_model(taken)
            served.manager.follow(served.settings)
            served.policy = Policy.from_settings(taken.batching)
            self.queue.add_lane(taken.name, served.policy, taken.batching.max_queue, taken.share)
        if failure is not None:
            return failure
        return "reloaded" if loaded else "updated" if taken != old else "unchanged"

    async def _change(self, served: ServedModel, part: str, change: Callable[[], ModelSlot | None]) -> str | None:
        """A SIGHUP's change of ``served`` (its model, or ``part``), off the loop: None when it went through, else
        the outcome that says why not (it serves as before)."""
        try:
            slot = await asyncio.to_thread(change)
        except ReloadInProgress:
            log.warning("SIGHUP: another change of %s is in progress; it was not changed%s", served.name, part)
            return "conflict"
        except ModelNotReady as exc:
            log.warning("SIGHUP: %s is not serving yet (%s); it was not changed%s", served.name, exc.state, part)
            return "not_ready"
        except ModelLoadError as exc:
            log.error("SIGHUP reload failed for model %s%s; it serves as before: %s", served.name, part, exc)
            return "failed"
        if slot is not None:
            log.info("SIGHUP: %s now serves %s%s", served.name, slot.version, part and " as its canary",
                     extra={"model": served.name, "version": slot.version, "path": str(slot.spec.path)})
        return None

    # -- requests (event loop) -------------------------------------------------------------------------

    async def process(self, request: InferenceRequest, disconnected: Callable[[], Awaitable[Any]] | None = None
                      ) -> TaskResult:
        """The one call: a request built by ``request`` (validated) through the model it names (or its task's
        default), one result per input, with the description of the model load that computed them. Raises
        EngineError, or ClientGone when ``disconnected`` returns first (core/admission.py Admission.serve_inputs)."""
        try:  # the model, resolved once for the request; a refusal is admission's to give, in its own order
            resolved: Resolved | None = self.registry.resolve(request.model, request.task, version=request.version,
                                                              allowed=request.allowed_models)
        except EngineError:
            resolved = None
        request = self.documents.with_default(request, resolved)
        if request.chunking is not None:
            return await self.documents.serve_pieces(request, disconnected, resolved)
        return await self.admission.serve_inputs(request, disconnected, resolved=resolved)

    def hold(self, model: str | None = None, task: str | None = None) -> AbstractAsyncContextManager[ModelSlot]:
        """A slot of the named (or ``task``'s default) model, held while the block runs; raises EngineError
        (core/admission.py Admission.hold)."""
        return self.admission.hold(model, task)

    @property
    def limits(self) -> Limits:
        """What any request may hold here, whichever model it names (core/request.py). Read per request: the
        largest lane bound is a figure the queue keeps as lanes change, not a scan of the lanes under its lock."""
        limits = self.settings.limits
        return Limits(limits.max_items_per_request, limits.max_chars_per_text, self.queue.largest_bound,
                      limits.max_document_chars)

    def request(self, inputs: Any, **options: Any) -> InferenceRequest:
        """``InferenceRequest.build`` under this server's limits (raises EngineError)."""
        return InferenceRequest.build(self.limits, inputs, **options)
