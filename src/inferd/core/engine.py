"""The inference engine: admission on the event loop, a batch worker on its own thread, a queue between.

This module only wires them: the bounded queue and the pure scheduler (core/batcher.py), the admission
side (core/admission.py: validate, route, cache, enqueue, wait, drain) and the worker (core/worker.py: run
batches, split on out-of-memory, free slots). The worker hands outcomes to admission, which applies them
on the loop. ``InferenceEngine`` keeps the one surface the API, the CLI and the tests use.

The engine builds the ModelManager too: a slot must be freed on the worker thread and its cache entries
forgotten on the loop, so the manager is handed those callbacks when it is built, not told them afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from inferd.config import Settings
from inferd.core.admission import Admission
from inferd.core.batcher import BatchQueue, Policy
from inferd.core.cache import ResultCache
from inferd.core.loading import load_handler
from inferd.core.manager import ModelManager, OnChange
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler
from inferd.core.work import TaskResult, WorkItem
from inferd.core.worker import BatchWorker
from inferd.utils.metrics import Metrics


def _claim(batch: list[WorkItem]) -> None:
    # Under the queue's lock, as the batch is chosen: its slot cannot be freed between take and run.
    slot: ModelSlot = batch[0].group  # type: ignore[assignment]
    slot.acquire()


class InferenceEngine:
    def __init__(self, settings: Settings, metrics: Metrics, memory_guard: Any = None, *,
                 loader: Callable[[ModelSpec], Handler] = load_handler, on_change: OnChange | None = None,
                 on_lazy_failure: Callable[[str], None] | None = None) -> None:
        """``loader``, ``on_change`` and ``on_lazy_failure`` are the ModelManager's (core/manager.py)."""
        self.settings = settings
        self.metrics = metrics
        self.memory_guard = memory_guard
        self.policy = Policy.from_settings(settings.batching)
        self.queue = BatchQueue(self.policy, settings.batching.max_queue, claim=_claim)
        # Keyed by the slot's load, not its version string: the cache answers only for the model it serves.
        self.cache = ResultCache(settings.cache.max_entries, metrics) if settings.cache.max_entries else None
        self.manager = ModelManager(settings, loader, on_change=on_change, on_lazy_failure=on_lazy_failure,
                                    reaper=self._on_worker, on_freed=self._slot_freed)
        self.admission = Admission(self.manager, settings, metrics, self.queue, self.policy, self.cache,
                                   worker_alive=lambda: self.alive)
        self.worker = BatchWorker(self.queue, metrics, memory_guard, deliver=self.admission.deliver)

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
        # After a timed-out drain the worker is stuck in a batch; waiting longer would only delay exit.
        self.worker.stop(0.1 if self.admission.abandoned else timeout)

    async def drain(self, timeout: float) -> bool:
        """Refuse new work, wait for what was accepted; past the timeout answer the rest (draining)."""
        return await self.admission.drain(timeout)

    def _on_worker(self, chore: Callable[[], None]) -> None:
        # A slot's free, on the worker thread (no slot is freed before the engine is built).
        self.worker.on_worker(chore)

    def _slot_freed(self, slot: ModelSlot, last_of_version: bool) -> None:
        if self.cache is not None:
            self.admission.on_loop(self.cache.forget, slot.load_id)  # the cache lives on the loop
        if last_of_version:
            # Retired versions' series would otherwise pile up with every reload.
            self.metrics.forget_version(slot.version)

    # -- requests (event loop) -------------------------------------------------------------------------

    async def run(self, inputs: list[Any], *, priority: int = 0, timeout_ms: float | None = None,
                  routing_key: str | None = None, model: str | None = None, task: str | None = None,
                  dimensions: int | None = None,
                  disconnected: Callable[[], Awaitable[Any]] | None = None) -> TaskResult:
        """One request's inputs through the model, one opaque result each (core/admission.py)."""
        return await self.admission.run(inputs, priority=priority, timeout_ms=timeout_ms, routing_key=routing_key,
                                        model=model, task=task, dimensions=dimensions, disconnected=disconnected)

    embed = run  # the name the embedding tests know

    def precheck(self, inputs: Any) -> list[Any]:
        """The checks that need no model (types, emptiness, counts, lengths), for the HTTP layer to run early."""
        return self.admission.precheck(inputs)
