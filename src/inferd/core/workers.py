"""Every model's batch workers: its instances (core/instances.py plan) and its background worker, and the shadow
lanes' one.

``Workers`` adds, re-budgets and retires a model's workers as the list of models changes, and gives the engine the
one surface it has of them: start, stop, whether all are alive, and running a posted call (a slot's free) on a
worker's thread. A model's instances take its live requests; its background worker takes its background items
(batch jobs' lines), whose passes stop while any live batch runs (core/background.py ``LiveFirst``, one here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from inferd.core.background import LiveFirst
from inferd.core.batcher import BatchQueue
from inferd.core.instances import Instance, Sharing, background_instance, plan, shadow_instance
from inferd.core.outcomes import Outcome
from inferd.core.worker import BatchWorker, call_posted
from inferd.settings import ModelEntry
from inferd.utils.metrics import Metrics


class Workers:
    """Every model's instances and the shadow lanes' one, behind the one surface the engine has of them."""

    def __init__(self, queue: BatchQueue, metrics: Metrics, memory_guard: Any,
                 deliver: Callable[[Outcome], None], device: str = "cpu") -> None:
        self.queue = queue
        self.metrics = metrics
        self.memory_guard = memory_guard
        self.deliver = deliver
        self._by_model: dict[str, list[BatchWorker]] = {}
        self._background: dict[str, BatchWorker] = {}
        self._retired: list[BatchWorker] = []
        self._guard_lock = threading.Lock()
        self._started = False
        self.live_first = LiveFirst()
        self._shadow = self._worker(shadow_instance(device))

    def _worker(self, instance: Instance) -> BatchWorker:
        return BatchWorker(self.queue, self.metrics, self.memory_guard, self.deliver, instance, self._guard_lock,
                           self.live_first)

    def set_model(self, entry: ModelEntry, device: str = "cpu") -> None:
        """A served model's instances as its (budget-resolved) entry says: added, or grown, shrunk, re-budgeted;
        and its background worker, on their threads together."""
        wanted = plan(entry, device)
        self._set_background(entry, wanted, device)
        workers = self._by_model.setdefault(entry.name, [])
        for own, instance in zip(self.instances(entry.name), wanted, strict=False):
            own.threads = instance.threads  # applied before its next batch
            own.background = instance.background  # read by its next take: the wake below
        self.queue.wake()
        for instance in wanted[len(workers):]:
            worker = self._worker(instance)
            workers.append(worker)
            if self._started:
                worker.start()
        while len(workers) > len(wanted):
            self._retire(workers.pop())
        sharing = Sharing() if len(workers) > 1 else None
        for own in self.instances(entry.name):
            own.sharing = sharing
        background = self._background.get(entry.name)
        if background is not None and background.instance is not None:
            background.instance.sharing = sharing

    def _set_background(self, entry: ModelEntry, wanted: list[Instance], device: str) -> None:
        """The model's background worker, on its instances' threads together; with ``background_pauses`` off, none:
        its instances take both kinds of work."""
        threads = sum(i.threads for i in wanted) if all(i.threads for i in wanted) else 0
        background = self._background.get(entry.name)
        if not entry.batching.background_pauses:
            for instance in wanted:
                instance.background = None
            if background is not None:
                self._retire(self._background.pop(entry.name))
            return
        if background is None:
            background = self._background[entry.name] = self._worker(background_instance(entry.name, threads, device))
            if self._started:
                background.start()
        if background.instance is not None:
            background.instance.threads = threads
            background.instance.nice = entry.batching.background_nice
            background.instance.share_cores = entry.batching.background_shares_cores

    def remove_model(self, name: str) -> None:
        for worker in self._by_model.pop(name, []):
            self._retire(worker)
        background = self._background.pop(name, None)
        if background is not None:
            self._retire(background)

    def _retire(self, worker: BatchWorker) -> None:
        worker.retire()
        self._retired.append(worker)

    def all(self) -> list[BatchWorker]:
        return [w for ws in self._by_model.values() for w in ws] + [*self._background.values(), self._shadow]

    def instances(self, model: str) -> list[Instance]:
        return [w.instance for w in self._by_model.get(model, []) if w.instance is not None]

    @property
    def shadow(self) -> Instance:
        assert self._shadow.instance is not None
        return self._shadow.instance

    def start(self) -> None:
        self._started = True
        for worker in self.all():
            worker.start()

    @property
    def alive(self) -> bool:
        return all(w.alive for w in self.all())

    @property
    def error(self) -> str | None:
        return next((w.error for w in self.all() if w.error is not None), None)

    @property
    def batches_run(self) -> int:
        return sum(w.batches_run for w in [*self.all(), *self._retired])

    def stop(self, timeout: float) -> None:
        self.queue.close()
        self.live_first.close()  # a background pass stopped for live work finishes now
        give_up = time.monotonic() + timeout
        for worker in [*self.all(), *self._retired]:
            if worker.thread is not None:
                worker.thread.join(max(0.0, give_up - time.monotonic()))
        if not any(w.thread is not None and w.thread.is_alive() for w in self.all()):
            call_posted(self.queue.take_posted())  # frees posted as the workers stopped

    def on_worker(self, call: Callable[[], None]) -> None:
        """Run ``call`` on a live instance's thread (a slot's free); here when this is one, or there is none."""
        threads = [w.thread for w in self.all() if w.runs_posted and w.thread is not None]
        alive = [t for t in threads if t.is_alive()]
        if not alive or threading.current_thread() in threads:
            call_posted([call])
        else:
            self.queue.post(call)
