"""A model slot: one loaded model (its handler and spec) with a reference count.

Requests and running batches hold a reference; a swap retires the old slot, which is freed only when its
last reference is released, on the thread its ``reaper`` names (the inference worker: a free runs
``handler.close`` and ``empty_cache``, which must not block the event loop).

Every load gets its own ``load_id``: the version string is the operator's label, and two loads may carry the
same one; whatever must never mix two models (the result cache) keys on the load, not on the label.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler, describe, task_of

log = logging.getLogger(__name__)

_load_ids = itertools.count(1)


def describe_model(handler: Handler, spec: ModelSpec, task: str, load_seconds: float, pads: bool) -> dict[str, Any]:
    """What is served, as /info, /v1/models, the admin API and the metrics show it: built once per load.

    The one place a handler's optional attributes get their defaults (a plug-in handler may have no
    ``backend``, ``dtype``, ``quantize`` or ``backend_info``). The task's own facts (an embedding's size and
    pooling, a classifier's labels) sit beside the common ones, which they cannot override.
    """
    return {
        "pooling": getattr(handler, "pooling", None), "normalize": getattr(handler, "normalize", None),
        **describe(handler),
        "name": spec.name, "version": spec.version, "path": str(spec.path), "task": task,
        "max_seq_length": getattr(handler, "max_seq_length", None),
        "device": str(getattr(handler, "device", "")), "dtype": getattr(handler, "dtype", None),
        "backend": getattr(handler, "backend", "torch"), "quantize": getattr(handler, "quantize", "none"),
        "backend_info": getattr(handler, "backend_info", None),
        "load_seconds": round(load_seconds, 3), "pads": pads}


class ModelSlot:
    def __init__(self, handler: Handler, spec: ModelSpec, load_seconds: float,
                 reaper: Callable[[Callable[[], None]], None] | None = None,
                 on_freed: Callable[[ModelSlot], None] | None = None) -> None:
        self.handler = handler
        self.spec = spec
        self.version = spec.version
        self.load_id = next(_load_ids)
        self.load_seconds = load_seconds
        # Where the free runs (None: on the thread that drops the last reference) and who hears of it.
        self._reaper = reaper
        self._on_freed = on_freed
        # Read once: describing a slot must not touch a handler that a concurrent swap may be freeing.
        self.task = task_of(handler)
        # Whether padded positions cost this model compute (the scheduler's padding floor follows it).
        self.pads = bool(getattr(getattr(handler, "runner", None), "pads", True))
        self.info = describe_model(handler, spec, self.task, load_seconds, self.pads)
        self.freed = threading.Event()
        self._refs = 0
        self._retired = False
        self._dead = False  # the free is decided (it may still be waiting for the reaper's thread)
        self._lock = threading.Lock()

    @property
    def refs(self) -> int:
        return self._refs

    @property
    def usable(self) -> bool:
        """False once the free is decided: nothing may run on this slot any more."""
        return not self._dead

    def acquire(self) -> ModelSlot:
        with self._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            free = self._retired and self._refs == 0 and not self._dead
            self._dead = self._dead or free
        if free:
            self._schedule_free()

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            free = self._refs == 0 and not self._dead
            self._dead = self._dead or free
        if free:
            self._schedule_free()

    def _schedule_free(self) -> None:
        if self._reaper is None:
            self._free()
        else:
            self._reaper(self._free)

    def _free(self) -> None:
        if self.freed.is_set():
            return
        # close() drops the weights; the handler object itself (a few attributes) goes with the slot, so a
        # reader that snapshotted the slot a moment before the swap still finds plain attributes on it.
        # Reference counting frees the tensors here; no gc.collect(): with torch loaded a full collection
        # holds the GIL for ~0.3 s.
        try:
            self.handler.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        finally:
            self.freed.set()
            log.info("model released", extra={"version": self.version})
            if self._on_freed is not None:
                self._on_freed(self)
