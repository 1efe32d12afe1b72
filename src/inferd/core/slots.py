"""A model slot: one loaded model (its handler and spec) with a reference count.

Requests and running batches hold a reference; a swap retires the old slot, which is freed only when its
last reference is released, on the thread ``post_to_worker`` hands it to (the inference worker's: a free runs
``handler.close`` and ``empty_cache``, which must not block the event loop).

Every load gets its own ``load_id``: the version string is the operator's label, and two loads may carry the
same one; whatever must never mix two models (the result cache) keys on the load, not on the label.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import fields
from types import MappingProxyType
from typing import Any, TypeAlias

import torch

from inferd.core.capabilities import Capabilities
from inferd.core.description import Loaded, ModelDescription
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler

log = logging.getLogger(__name__)

_load_ids = itertools.count(1)

# Hands a call to the thread that runs batches (the engine's worker), which runs it between two batches.
PostToWorker: TypeAlias = Callable[[Callable[[], None]], None]


# What the load itself says, whatever a handler's facts (``Loaded.facts.other``) claim beside the task's.
_LOAD_FIELDS = frozenset(f.name for f in fields(ModelDescription)) - {"facts"}


def describe_load(loaded: Loaded, task: str, spec: ModelSpec, load_id: int, load_seconds: float) -> ModelDescription:
    """The one place a load's description is built: what the load found (``Handler.load``'s ``Loaded``) and its
    task's facts, each taken as they are."""
    facts = loaded.facts  # a TaskFacts: Handler.open refused anything else
    matryoshka = facts.matryoshka_dimensions
    return ModelDescription(
        name=spec.name, version=spec.version, load_id=load_id, path=str(spec.path), task=task,
        # As the facts say it: a multi-vector handler's own ``dimension`` is its token vectors', not a pooled one's.
        dimension=None if facts.dimension is None else int(facts.dimension),
        normalize=facts.normalize, pooling=facts.pooling,
        prompts=None if facts.prompts is None else MappingProxyType(dict(facts.prompts)),
        default_prompt_name=facts.default_prompt_name,
        matryoshka_dimensions=tuple(matryoshka) if isinstance(matryoshka, list | tuple) else matryoshka,
        similarity_fn_name=facts.similarity_fn_name,
        labels=None if facts.labels is None else tuple(facts.labels), multi_label=bool(facts.multi_label),
        max_seq_length=loaded.max_seq_length, dtype=loaded.dtype, device=loaded.device,
        backend=loaded.backend, quantize=loaded.quantize,
        backend_info=None if loaded.backend_info is None else dict(loaded.backend_info),
        load_seconds=round(load_seconds, 3),
        facts=MappingProxyType({k: v for k, v in facts.other.items() if k not in _LOAD_FIELDS}))


class ModelSlot:
    """One loaded model, its description, and the references requests and batches hold on it."""

    def __init__(self, handler: Handler, spec: ModelSpec, load_seconds: float,
                 post_to_worker: PostToWorker | None = None,
                 on_freed: Callable[[ModelSlot], None] | None = None) -> None:
        self.handler = handler
        self.spec = spec
        self.version = spec.version
        self.load_id = next(_load_ids)
        self.load_seconds = load_seconds
        # Where the free runs (None: on the thread that drops the last reference) and who hears of it.
        self._post_to_worker = post_to_worker
        self._on_freed = on_freed
        # What the load found, taken once: describing a slot must not touch a handler that a concurrent swap may be
        # freeing. ``loaded.tokenizer`` serves TEI's /tokenize and the long-document splitter.
        self.loaded = handler.loaded
        self.description = describe_load(self.loaded, handler.task, spec, self.load_id, load_seconds)
        self.task = self.description.task
        # What its forward pass can do: the runner's one value, held (not copied apart) for the scheduler's padding
        # floor (core/scheduler.py ``Slot``) and the worker's batch alone on every thread.
        self.capabilities: Capabilities = self.loaded.capabilities
        # This load's int8/uint8 calibration vectors, measured on it the first time a request asks (a future,
        # on the event loop: core/admission.py); they go with the slot.
        self.calibration: Any = None
        self.freed = threading.Event()
        self._refs = 0
        self._retired = False
        self._free_decided = False  # it may still wait for the worker's thread to run it
        self._lock = threading.Lock()

    @property
    def refs(self) -> int:
        return self._refs

    @property
    def usable(self) -> bool:
        """False once the free is decided: nothing may run on this slot any more."""
        return not self._free_decided

    def acquire(self) -> ModelSlot:
        with self._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            free = self._retired and self._refs == 0 and not self._free_decided
            self._free_decided = self._free_decided or free
        if free:
            self._schedule_free()

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            free = self._refs == 0 and not self._free_decided
            self._free_decided = self._free_decided or free
        if free:
            self._schedule_free()

    def _schedule_free(self) -> None:
        if self._post_to_worker is None:
            self._free()
        else:
            self._post_to_worker(self._free)

    def _free(self) -> None:
        if self.freed.is_set():
            return
        # close() drops the weights; the handler object itself (a few attributes) goes with the slot, so a
        # reader that snapshotted the slot a moment before the swap still finds plain attributes on it.
        # Reference counting frees the tensors here; no gc.collect(): with torch loaded a full collection
        # holds the GIL 0.20-0.26 s (bench/RESULTS.md, "The collector").
        try:
            self.handler.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        finally:
            self.freed.set()
            log.info("model released", extra={"version": self.version})
            if self._on_freed is not None:
                self._on_freed(self)
