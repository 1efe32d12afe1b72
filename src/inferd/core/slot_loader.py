"""Loading a model into a slot beside the serving one, and whether the loaded model may serve there.

A load is the handler's own (core/loading.py ``load_handler``, or a test's fake), held to the model's share of the
device (``model.memory_fraction``), followed by a settled heap, and registered in the slot table until it is freed.
A model loaded to serve beside or instead of the serving one is refused when it is another task, when its task's
own rule refuses the change (a dimension change unless allowed), or, for a canary, when its vectors are not the
serving model's space (core/space_check.py). A canary's size is that space check's to judge, not the dimension rule's:
another size is another space, which the canary's ``force`` overrides (docs/changing-a-model.md). A refused slot is
retired before the refusal is raised.

``settings`` are the model's as last read (a SIGHUP's, ModelManager.follow): each load reads them when it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeAlias

from inferd.core import load_guard
from inferd.core.errors import ManagerClosed, ModelLoadError, ModelNotReady, TaskMismatch
from inferd.core.loading import load_handler
from inferd.core.memory import device_memory, settle_heap
from inferd.core.slot_table import SlotTable
from inferd.core.slots import ModelSlot, PostToWorker
from inferd.core.space_check import space_changed
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler
from inferd.core.tasks.embedding import allows_change
from inferd.core.tasks.kinds import task_of
from inferd.settings import Settings

log = logging.getLogger(__name__)

# What builds a model's handler from its spec (load_handler; a test's fake).
Loader: TypeAlias = Callable[[ModelSpec], Handler]


class SlotLoader:
    """Loads slots for one model's slot table and judges whether a loaded one may serve beside its active slot."""

    def __init__(self, settings: Settings, table: SlotTable, loader: Loader = load_handler,
                 post_to_worker: PostToWorker | None = None) -> None:
        self.settings = settings
        self.loader = loader
        self._table = table
        # Where a slot's free and the space check run (the engine's worker thread); None: on the calling thread.
        self._post_to_worker = post_to_worker

    def load(self, spec: ModelSpec) -> ModelSlot:
        """``spec`` loaded into a new slot, registered in the table; ModelLoadError when it cannot be."""
        if self.settings.model.load_delay_s:
            # Every load, reloads included: makes "loading" and "reload in progress" observable in tests (and a
            # change's cancel: the wait is cut short by it).
            load_guard.sleep(self.settings.model.load_delay_s)
        started = time.perf_counter()
        fraction = spec.settings.memory_fraction
        before = device_memory(spec.settings.device) if fraction is not None else None
        try:
            handler = self.loader(spec)
        except ModelLoadError:
            raise
        except Exception as exc:  # a broken model folder can raise nearly anything from transformers
            raise ModelLoadError(f"cannot load {spec.path}: {type(exc).__name__}: {exc}") from exc
        try:
            load_guard.stage("loaded")
        except ModelLoadError:
            handler.close()  # abandoned while it loaded: what it built goes now
            raise
        if before is not None and fraction is not None:
            _within_budget(handler, spec, before, fraction)
        if self.settings.memory.freeze_heap:
            settled = settle_heap()
            log.debug("heap frozen after the load", extra={"model": spec.name, "seconds": round(settled, 3)})
        slot = ModelSlot(handler, spec, time.perf_counter() - started, post_to_worker=self._post_to_worker,
                         on_freed=self._table.freed)
        self._table.register(slot)
        return slot

    def load_standby(self, spec: ModelSpec, allow_change: bool | None = None) -> ModelSlot:
        """Load beside the serving model; refuse one of another task, or one the task's own rule refuses
        (``allow_change``: the configuration's consent to a dimension change; None: the served settings')."""
        table = self._table
        if table.closed:
            raise ManagerClosed("the server is shutting down; no model change is accepted")
        active = table.active
        if active is None and table.state != "failed":
            # Still loading (or lazy and not yet loaded): the first model is the first load's to install.
            raise ModelNotReady(table.state, table.reason)
        table.refuse_served_version(spec.version)
        slot = self.load(spec)
        if allow_change is None:
            allow_change = allows_change(self.settings.model)
        if active is not None:
            try:
                why = refusal(slot, active, allow_change)
            except TaskMismatch:
                slot.retire()
                raise
            if why is not None:
                slot.retire()
                raise ModelLoadError(f"the new model's {why}")
        return slot

    def space_changed(self, slot: ModelSlot, active: ModelSlot | None = None) -> str | None:
        """For an embedding canary: why its vectors are not ``active``'s space (default: the active model's;
        None: they are), measured on the worker (core/space_check.py)."""
        active = active or self._table.active
        if active is None:
            return None
        new, old = slot.description.dimension, active.description.dimension
        if (task_of(slot.task).stored_vectors and task_of(active.task).stored_vectors and None not in (new, old)
                and new != old):
            # Known from the loads alone: said even where the measure cannot run (a handler that cannot embed the
            # built-in texts), so a canary of another size is never let through unmeasured.
            return (f"the canary's embedding space differs from the active model's: its vectors have {new} "
                    f"dimensions, the active model's {old}. Clients indexing during a canary would store vectors of "
                    "two spaces that no query can search together; shadow it instead (POST /admin/models/shadow), "
                    "or force the canary (force: true)")
        return space_changed(slot, active, self.settings.model.gate.int8_cosine_min, self._post_to_worker)


def refusal(new: ModelSlot, serving: ModelSlot, allow_change: bool) -> str | None:
    """Why ``new`` may not serve beside or instead of ``serving``: another task (raised), or the task's rule."""
    if new.task != serving.task:
        raise TaskMismatch(new.task, serving.task, "active")
    return new.handler.incompatibility(serving.description, allow_change)


def _within_budget(handler: Handler, spec: ModelSpec, before: tuple[int, int], fraction: float) -> None:
    """A model of several on one GPU: its load may take ``model.memory_fraction`` of the device, no more."""
    after = device_memory(spec.settings.device)
    if after is None:
        return
    taken, total = after[0] - before[0], after[1]
    if taken > fraction * total:
        handler.close()
        raise ModelLoadError(f"model {spec.name!r} took {taken / 2**30:.2f} GiB of the device's "
                             f"{total / 2**30:.2f} GiB to load, more than its model.memory_fraction "
                             f"{fraction:g} ({fraction * total / 2**30:.2f} GiB)")
