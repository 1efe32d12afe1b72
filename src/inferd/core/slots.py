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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler, describe, task_of

log = logging.getLogger(__name__)

_load_ids = itertools.count(1)


# The description's typed fields, by the name the dict form (/info, the reload rules) gives them.
_TASK_FIELDS = ("dimension", "matryoshka_dimensions", "prompts", "default_prompt_name", "labels")
_COMMON = ("name", "version", "path", "task", "max_seq_length", "device", "dtype", "backend", "quantize",
           "backend_info", "load_seconds", "pads")


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What one model load is, built once when it is loaded and never read from the handler again.

    Every reader takes it from here: /info, /v1/models, the admin API, the metrics, and the routes, which
    shape an answer with the description that travels with the result (core/work.py TaskResult), so an answer
    computed by a canary is shaped by the canary's prompts, normalisation and labels. ``prompts`` is None for
    a task without prompts; ``facts`` holds the task's other facts (an embedding's Dense layers and similarity,
    a classifier's multi_label, a reranker's activation, a plug-in's own), shown as they are.
    """

    name: str
    version: str
    load_id: int
    path: str
    task: str
    dimension: int | None = None
    normalize: bool | None = None
    pooling: str | None = None
    prompts: Mapping[str, str] | None = None
    default_prompt_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] | str | None = None  # sizes, "any", or None
    labels: tuple[str, ...] | None = None
    max_seq_length: int | None = None
    device: str = ""
    dtype: str | None = None
    backend: str = "torch"
    quantize: str = "none"
    backend_info: Mapping[str, Any] | None = None
    load_seconds: float = 0.0
    pads: bool = True
    facts: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, handler: Handler, spec: ModelSpec, load_id: int, task: str, load_seconds: float,
           pads: bool) -> ModelDescription:
        """The one place a handler's optional attributes get their defaults (a plug-in handler may have no
        ``backend``, ``dtype``, ``quantize`` or ``backend_info``). The task's own facts cannot override the
        common ones."""
        told = {k: v for k, v in describe(handler).items() if k not in _COMMON}
        matryoshka = told.pop("matryoshka_dimensions", None)
        prompts, labels = told.pop("prompts", None), told.pop("labels", None)
        dimension = told.pop("dimension", None)
        return cls(
            name=spec.name, version=spec.version, load_id=load_id, path=str(spec.path), task=task,
            dimension=None if dimension is None else int(dimension),
            normalize=told.pop("normalize", getattr(handler, "normalize", None)),
            pooling=told.pop("pooling", getattr(handler, "pooling", None)),
            prompts=None if prompts is None else MappingProxyType(dict(prompts)),
            default_prompt_name=told.pop("default_prompt_name", None),
            matryoshka_dimensions=tuple(matryoshka) if isinstance(matryoshka, list | tuple) else matryoshka,
            labels=None if labels is None else tuple(labels),
            max_seq_length=getattr(handler, "max_seq_length", None), device=str(getattr(handler, "device", "")),
            dtype=getattr(handler, "dtype", None), backend=getattr(handler, "backend", "torch"),
            quantize=getattr(handler, "quantize", "none"), backend_info=getattr(handler, "backend_info", None),
            load_seconds=round(load_seconds, 3), pads=pads, facts=MappingProxyType(told))

    def as_dict(self) -> dict[str, Any]:
        """The description as /info, the admin API and the reload rules (a handler's ``incompatibility``)
        read it: the task's facts it has, then the common ones."""
        task = {k: getattr(self, k) for k in _TASK_FIELDS if getattr(self, k) is not None}
        if isinstance(self.matryoshka_dimensions, tuple):
            task["matryoshka_dimensions"] = list(self.matryoshka_dimensions)
        if self.prompts is not None:
            task["prompts"] = dict(self.prompts)
        if self.labels is not None:
            task["labels"] = list(self.labels)
        return {"pooling": self.pooling, "normalize": self.normalize, **task, **self.facts,
                **{k: getattr(self, k) for k in _COMMON}}


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
        self.description = ModelDescription.of(handler, spec, self.load_id, self.task, load_seconds, self.pads)
        self.info = self.description.as_dict()
        # This load's int8/uint8 calibration vectors, measured on it the first time a request asks (a future,
        # on the event loop: core/admission.py); they go with the slot.
        self.calibration: Any = None
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
