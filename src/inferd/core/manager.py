"""The ModelManager: which model slots serve (an active one, an optional canary), swapped under traffic.

A swap loads the new model beside the serving one, replaces the pointer under a lock (atomic for every new
request) and retires the old slot, freed when its last request lets go (core/slots.py). A failed load, or
a model the task's own rule refuses, leaves the serving model in place. A change that loads runs one at a time,
bounded by ``model.load_timeout_s`` and cancellable (``cancel_load``, core/load_guard.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias, TypeVar

from inferd.core import load_guard
from inferd.core.backends.auto import AutoUpgrade, ModelChangeBusy, by_name, remember, remembered
from inferd.core.errors import (
    ManagerClosed,
    ModelNotReady,
    NoCanary,
    NoLoadInProgress,
    NoShadow,
    ReloadInProgress,
    SpaceChanged,
    TaskMismatch,
    VersionInUse,
)
from inferd.core.load_guard import LoadGuard
from inferd.core.loading import check_model_path, load_handler, spec_task
from inferd.core.memory import device_memory, settle_heap
from inferd.core.shadow import MIN_ITEMS, Shadow
from inferd.core.shadow_slot import ShadowSlot
from inferd.core.slots import ModelSlot
from inferd.core.space_check import space_changed
from inferd.core.spec import ModelSpec, spec_from_settings
from inferd.core.tasks.base import Handler, ModelLoadError
from inferd.core.tasks.embedding import allows_change
from inferd.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

# Told the served slots after every change (the app publishes them as metrics).
OnChange: TypeAlias = Callable[[list[tuple[str, ModelSlot]]], None]
# Told when a slot is freed, and whether it was the last loaded slot of its version.
OnFreed: TypeAlias = Callable[[ModelSlot, bool], None]


class ModelManager:
    """Holds the active slot (and an optional canary), loads new models beside them, swaps atomically."""

    def __init__(self, settings: Settings, loader: Callable[[ModelSpec], Handler] = load_handler, *,
                 on_change: OnChange | None = None,
                 reaper: Callable[[Callable[[], None]], None] | None = None,
                 on_freed: OnFreed | None = None,
                 on_lazy_failure: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.loader = loader
        self._on_change: OnChange = on_change or (lambda slots: None)
        # Runs a slot's free on the right thread (the engine's: its worker); None = where it is released.
        self._reaper = reaper
        # Told when a slot is freed, and whether it was the last loaded slot of its version (then the
        # version's labelled metric series can go).
        self._on_freed: OnFreed = on_freed or (lambda slot, last_of_version: None)
        # Told when a lazy first load fails (the app exits there if model.exit_on_load_failure is set).
        self._on_lazy_failure: Callable[[str], None] = on_lazy_failure or (lambda reason: None)
        self.state = "not_loaded"
        self.reason: str | None = None
        self.active: ModelSlot | None = None
        self.canary: ModelSlot | None = None
        self.canary_weight = 0.0
        # A candidate computing mirrored traffic beside the active model (core/shadow_slot.py); never answers.
        self._shadow = ShadowSlot(settings)
        # backend auto: the background judge of faster runtimes for the active load (core/backends/auto.py).
        self.auto = AutoUpgrade(settings.model.auto_candidates) if settings.model.backend == "auto" else None
        self.switches = 0
        self._closed = False
        self._live: dict[int, ModelSlot] = {}  # loaded and not yet freed, by load_id
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()
        # The model change loading now (None: none), which the admin API may cancel (core/load_guard.py).
        self._loading: LoadGuard | None = None
        self._lazy_lock = asyncio.Lock()
        self._initial = spec_from_settings(settings)
        # The configured model's task as its folder says (``task: auto``), read once: routing asks before a lazy
        # model's load, for every request, on the event loop (config.json and modules.json are files to read).
        self._initial_task: str | None = None
        roots = [Path(r).expanduser().resolve() for r in settings.model.root]
        self.roots = roots or [self._initial.path.expanduser().resolve().parent]

    # -- loading ---------------------------------------------------------------------------------------

    def _load(self, spec: ModelSpec) -> ModelSlot:
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
            self._within_budget(handler, spec, before, fraction)
        if self.settings.memory.freeze_heap:
            settled = settle_heap()
            log.debug("heap frozen after the load", extra={"model": spec.name, "seconds": round(settled, 3)})
        slot = ModelSlot(handler, spec, time.perf_counter() - started, reaper=self._reaper, on_freed=self._freed)
        with self._lock:
            self._live[slot.load_id] = slot
        return slot

    @staticmethod
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

    def _freed(self, slot: ModelSlot) -> None:
        with self._lock:
            self._live.pop(slot.load_id, None)
            # A version can be loaded again while its old slot still drains; its series stay until both go.
            last = all(s.version != slot.version for s in self._live.values())
        self._on_freed(slot, last)

    def load_initial(self) -> None:
        """Load the configured model (and canary); record failure instead of raising."""
        self.state = "loading"
        try:
            slot = self._first_load()
            canary = None
            c = self.settings.canary
            if c.path and c.weight > 0:
                try:
                    canary = self._load(spec_from_settings(self.settings, Path(c.path), c.version or "canary"))
                    why = self._refusal(canary, slot, allows_change(self.settings.model))
                    if why is not None:
                        raise ModelLoadError(f"canary.path {c.path}: {why}")
                    if canary.version == slot.version:
                        raise ModelLoadError(f"canary.version {canary.version!r} is the model's own version; "
                                             "give the canary its own")
                    space = self._space_changed(canary, slot)
                    if space is not None and not c.force:
                        raise ModelLoadError(f"canary.path {c.path}: {space} (canary.force: true at start)")
                    if space is not None:
                        log.warning("canary forced although its space differs: %s", space,
                                    extra={"version": canary.version})
                except ModelLoadError:
                    slot.retire()
                    if canary is not None:
                        canary.retire()
                    raise
        except ModelLoadError as exc:
            self.state, self.reason = "failed", str(exc)
            log.error("model load failed: %s", exc)
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self.active = slot
                if canary is not None:
                    self.canary, self.canary_weight = canary, self.settings.canary.weight
                self.state = "ready"
        if closed:
            # Shutdown began while this loaded: nothing may serve after close, so it is freed at once.
            for s in (slot, canary):
                if s is not None:
                    s.retire()
            log.info("the model finished loading after shutdown began; released unused")
            return
        log.info("model ready", extra={"model": slot.spec.name, "version": slot.version,
                                        "load_seconds": round(slot.load_seconds, 3)})
        self._changed()
        self._judge_runtimes(slot)

    def _first_load(self) -> ModelSlot:
        """The configured model; under backend auto, on the runtime a previous start chose for it where the cache
        still holds it (a warm start: no torch first, nothing judged again), else on torch."""
        name = remembered(self._initial) if self.auto is not None and self._initial.backend == "auto" else None
        if name is not None and self.auto is not None:
            try:
                slot = self._load(dataclasses.replace(self._initial, **by_name(name).runtime()))
            except ModelLoadError as exc:
                log.warning("backend auto: the cached choice %s did not load (%s); starting on torch", name, exc)
            else:
                self.auto.adopt(name, "chosen by an earlier start on this machine (its cache entry, judged again)")
                log.info("backend auto: serving %s at once, as an earlier start on this machine chose", name)
                return slot
        return self._load(self._initial)

    async def ensure_loaded(self) -> None:
        """Lazy mode: the first request loads the model, exactly once however many arrive together."""
        if self.state == "ready":
            return
        async with self._lazy_lock:
            if self.state in ("not_loaded",):
                try:
                    await asyncio.to_thread(self.load_initial)
                except ModelLoadError as exc:
                    self._on_lazy_failure(str(exc))
        if self.state != "ready":
            raise ModelNotReady(self.state, self.reason)

    def _changed(self) -> None:
        self._on_change(self.slots())

    # -- routing ---------------------------------------------------------------------------------------

    def pick(self, routing_key: str | None = None, model: str | None = None) -> ModelSlot:
        """The slot this request runs on, with a reference taken (release it when the request ends)."""
        with self._lock:
            active, canary = self.active, self.canary
            if active is None:
                raise ModelNotReady(self.state, self.reason)
            slot = active
            if canary is not None:
                if model and model in (canary.version, f"{canary.spec.name}@{canary.version}"):
                    slot = canary
                elif model and model in (active.version, f"{active.spec.name}@{active.version}"):
                    slot = active
                elif routing_key is not None:
                    slot = canary if _bucket(routing_key) < self.canary_weight else active
                else:
                    slot = canary if random.random() < self.canary_weight else active
            return slot.acquire()

    @property
    def shadow(self) -> Shadow | None:
        """The shadow candidate (None: none), its share and its drift report."""
        return self._shadow.candidate

    def pick_shadow(self, routing_key: str | None, draw: float) -> Shadow | None:
        """The shadow candidate, with a reference on its slot, if this request is sampled for it."""
        with self._lock:
            return self._shadow.pick(routing_key, draw)

    def slots(self) -> list[tuple[str, ModelSlot]]:
        with self._lock:
            out = [("active", self.active)] if self.active else []
            if self.canary:
                out.append(("canary", self.canary))
            return out  # type: ignore[return-value]

    # -- lifecycle -------------------------------------------------------------------------------------

    def _refuse_served_version(self, version: str) -> None:
        """A model change may not reuse the label of a model being served: two models would be one to
        clients (X-Model-Version, pinning), to metrics and to the cache."""
        with self._lock:
            shadow = self.shadow.slot if self.shadow is not None else None
            for role, slot in (("active", self.active), ("canary", self.canary), ("shadow", shadow)):
                if slot is not None and slot.version == version:
                    raise VersionInUse(version, role)

    def _load_standby(self, spec: ModelSpec, allow_change: bool | None = None) -> ModelSlot:
        """Load beside the serving model; refuse one of another task, or one the task's own rule refuses."""
        if self._closed:
            raise ManagerClosed("the server is shutting down; no model change is accepted")
        active = self.active
        if active is None and self.state != "failed":
            # Still loading (or lazy and not yet loaded): the first model is load_initial's to install.
            raise ModelNotReady(self.state, self.reason)
        self._refuse_served_version(spec.version)
        slot = self._load(spec)
        if allow_change is None:
            allow_change = allows_change(self.settings.model)
        if active is not None:
            try:
                why = self._refusal(slot, active, allow_change)
            except TaskMismatch:
                slot.retire()
                raise
            if why is not None:
                slot.retire()
                raise ModelLoadError(f"the new model's {why}")
        return slot

    @staticmethod
    def _refusal(new: ModelSlot, serving: ModelSlot, allow_change: bool) -> str | None:
        """Why ``new`` may not serve beside or instead of ``serving``: another task (raised), or the task's rule."""
        if new.task != serving.task:
            raise TaskMismatch(new.task, serving.task, "active")
        return new.handler.incompatibility(serving.description, allow_change)

    @property
    def task(self) -> str | None:
        """The task served: the loaded model's, or before a load the configured one (None: unknown yet)."""
        active = self.active
        if active is not None:
            return active.task
        if self._initial_task is None:
            try:
                self._initial_task = spec_task(self._initial)
            except ModelLoadError:
                return None  # not cached: the folder may yet be put right before the load
        return self._initial_task

    def _exclusive(self) -> None:
        if not self._reload_lock.acquire(blocking=False):
            raise ReloadInProgress("another model change is in progress")

    def _guarded(self, action: str, work: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run a change that loads a model, one at a time: bounded by ``model.load_timeout_s`` and cancellable
        (cancel_load); either ends it at once for the caller and frees the change lock (core/load_guard.py)."""
        self._exclusive()
        limit = self.settings.model.load_timeout_s if timeout_s is None else timeout_s
        guard = LoadGuard(action, limit)
        with self._lock:
            self._loading = guard
        try:
            return load_guard.guarded(guard, work)
        finally:
            with self._lock:
                mine = self._loading is guard  # else cancel_load took the lock's release upon itself
                if mine:
                    self._loading = None
            if mine:
                self._reload_lock.release()

    @property
    def loading(self) -> LoadGuard | None:
        """The model change loading now, if any (its action, stage and age)."""
        return self._loading

    def cancel_load(self, reason: str = "cancelled through the admin API") -> LoadGuard:
        """Abandon the model change loading now: the serving model stays, the change lock is free at once, and
        the load stops at its next stage (core/load_guard.py). NoLoadInProgress when none is (or it has just
        installed its model)."""
        with self._lock:
            guard = self._loading
            if guard is None or not guard.cancel(reason):
                raise NoLoadInProgress("no model change is loading (none started, or it has just finished)")
            self._loading = None
        self._reload_lock.release()
        log.warning("model change cancelled", extra={"action": guard.action, "stage": guard.stage,
                                                      "seconds": round(guard.seconds, 3)})
        return guard

    @staticmethod
    def _commit(slot: ModelSlot) -> None:
        """The guarded change installs ``slot`` now; abandoned first, the slot is freed and the change raises."""
        try:
            load_guard.commit()
        except ModelLoadError:
            slot.retire()
            raise

    def _discard_after_close(self, slot: ModelSlot) -> ManagerClosed:
        # close() already emptied the slots; installing this one would serve (and leak) a model after it.
        slot.retire()
        log.info("a model change finished after shutdown began; its model was released, nothing switched",
                 extra={"version": slot.version})
        return ManagerClosed("the server is shutting down; the model change was discarded")

    def _switch(self, slot: ModelSlot) -> None:
        self._commit(slot)
        with self._lock:
            closed = self._closed
            if not closed:
                old, self.active = self.active, slot
                self.switches += 1
                # A reload after a failed start is how an operator recovers without a restart.
                self.state, self.reason = "ready", None
                self._shadow.active_changed()
        if closed:
            raise self._discard_after_close(slot)
        log.info("model switched", extra={"model": slot.spec.name, "version": slot.version,
                                           "previous": old.version if old else None,
                                           "load_seconds": round(slot.load_seconds, 3)})
        if old is not None:
            old.retire()
        self._changed()
        self._judge_runtimes(slot)

    def _judge_runtimes(self, slot: ModelSlot) -> None:
        """backend auto: a load on torch starts the judging of faster runtimes for it (a candidate's own load,
        whose spec names its runtime, does not)."""
        if self.auto is None or slot.spec.backend != "auto":
            return
        d = slot.description
        self.auto.start(d.runtime, lambda runtime: self.switch_runtime(slot, runtime), cuda=d.device.startswith("cuda"))

    def switch_runtime(self, base: ModelSlot, runtime: dict[str, str]) -> ModelSlot:
        """backend auto: serve ``base``'s folder and version on another runtime, loaded beside it and swapped in as a
        reload is (core/backends/auto.py). Refused once ``base`` no longer serves (a reload came first)."""
        def serving() -> None:
            if self.active is not base:
                raise ModelLoadError("the model changed while backend auto judged a faster runtime for it")

        def work() -> ModelSlot:
            serving()
            slot = self._load(dataclasses.replace(base.spec, **runtime))
            try:
                serving()
            except ModelLoadError:
                slot.retire()
                raise
            self._switch(slot)
            d = slot.description
            remember(base.spec, d.runtime, (d.backend_info or {}).get("cache_entry"))
            return slot

        try:
            return self._guarded("auto", work)
        except ReloadInProgress as exc:
            raise ModelChangeBusy(str(exc)) from exc

    def _client_spec(self, path: str, version: str, runtime: dict[str, str] | None) -> ModelSpec:
        """A client's load: ``path`` must lie under an allowed ``model.root``; ``runtime`` (backend, dtype,
        quantize) overrides the configured runtime for this load only."""
        spec = spec_from_settings(self.settings, check_model_path(path, self.roots), version)
        return dataclasses.replace(spec, **runtime) if runtime else spec  # keeps its root and text limit

    def reload(self, path: str, version: str, runtime: dict[str, str] | None = None) -> ModelSlot:
        """Load into standby, then switch atomically; the old slot is freed when its requests finish."""
        def work() -> ModelSlot:
            slot = self._load_standby(self._client_spec(path, version, runtime))
            self._switch(slot)
            return slot

        return self._guarded("reload", work)

    def reload_from_settings(self, settings: Settings) -> ModelSlot:
        """SIGHUP: serve the model section of freshly read settings (path, version, pooling, task...).

        The configuration is the operator's own, like the path the server started with, so it is not held
        to ``model.root``; the task's compatibility rule still applies, by the new configuration's consent, and so does
        the version rule (a new model needs a new ``model.version``).
        """
        def work() -> ModelSlot:
            slot = self._load_standby(spec_from_settings(settings), allows_change(settings.model))
            self._switch(slot)
            return slot

        return self._guarded("reload", work, settings.model.load_timeout_s)

    def set_canary(self, path: str, version: str, weight: float,
                   runtime: dict[str, str] | None = None, force: bool = False) -> ModelSlot:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"canary weight must lie in [0, 1], not {weight}")

        def work() -> ModelSlot:
            if self.active is None and not self._closed:
                raise ModelNotReady(self.state, self.reason)
            slot = self._load_standby(self._client_spec(path, version, runtime))
            why = self._space_changed(slot)
            if why is not None and not force:
                slot.retire()
                raise SpaceChanged(why)
            if why is not None:
                log.warning("canary forced although its space differs: %s", why, extra={"version": slot.version})
            self._commit(slot)
            with self._lock:
                closed = self._closed
                if not closed:
                    old, self.canary, self.canary_weight = self.canary, slot, weight
            if closed:
                raise self._discard_after_close(slot)
            log.info("canary set", extra={"version": slot.version, "weight": weight})
            if old is not None:
                old.retire()
            self._changed()
            return slot

        return self._guarded("canary", work)

    def promote(self) -> ModelSlot:
        """The canary becomes the active model; the old active is retired."""
        self._exclusive()
        try:
            with self._lock:
                if self.canary is None:
                    raise NoCanary("there is no canary to promote")
                old, self.active, self.canary, self.canary_weight = self.active, self.canary, None, 0.0
                self.switches += 1
                new = self.active
            log.info("canary promoted", extra={"version": new.version, "previous": old.version if old else None})
            if old is not None:
                old.retire()
            self._changed()
            return new
        finally:
            self._reload_lock.release()

    def rollback(self) -> ModelSlot:
        """Drop the canary; all traffic returns to the active model."""
        self._exclusive()
        try:
            with self._lock:
                if self.canary is None:
                    raise NoCanary("there is no canary to roll back")
                old, self.canary, self.canary_weight = self.canary, None, 0.0
                active = self.active
            log.info("canary rolled back", extra={"version": old.version})
            old.retire()
            self._changed()
            return active  # type: ignore[return-value]
        finally:
            self._reload_lock.release()

    # -- shadow --------------------------------------------------------------------------------------------

    def _space_changed(self, slot: ModelSlot, active: ModelSlot | None = None) -> str | None:
        """For an embedding canary: why its vectors are not ``active``'s space (default: the active model's;
        None: they are), measured on the worker (core/space_check.py)."""
        active = active or self.active
        if active is None:
            return None
        return space_changed(slot, active, self.settings.model.gate.int8_cosine_min, self._reaper)

    def set_shadow(self, path: str, version: str, weight: float,
                   runtime: dict[str, str] | None = None) -> ModelSlot:
        """Load a candidate beside the active model (the checks of a canary) that computes ``weight`` of the
        live requests off the response path; a previous candidate and its report are replaced."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"shadow weight must lie in [0, 1], not {weight}")

        def work() -> ModelSlot:
            if self.active is None and not self._closed:
                raise ModelNotReady(self.state, self.reason)
            slot = self._load_standby(self._client_spec(path, version, runtime))
            self._commit(slot)
            with self._lock:
                closed = self._closed
                if not closed:
                    old = self._shadow.replace(slot, weight)
            if closed:
                raise self._discard_after_close(slot)
            log.info("shadow set", extra={"version": slot.version, "weight": weight})
            if old is not None:
                old.slot.retire()
            return slot

        return self._guarded("shadow", work)

    def drop_shadow(self) -> Shadow:
        """Stop shadowing; the candidate is freed once its queued work lets go. Returns it (its final report)."""
        self._exclusive()
        try:
            with self._lock:
                old = self._shadow.take()
            if old is None:
                raise NoShadow("there is no shadow candidate")
            log.info("shadow dropped", extra={"version": old.slot.version})
            old.slot.retire()
            return old
        finally:
            self._reload_lock.release()

    def promote_shadow(self, force: bool = False, min_items: int = MIN_ITEMS) -> ModelSlot:
        """The shadow candidate becomes the active model when its drift report allows it (or ``force``)."""
        self._exclusive()
        try:
            with self._lock:
                canary = self.canary
            # Judged outside the lock (the report's figures take their own); one change at a time holds it still.
            shadow = self._shadow.promotable(canary, force, min_items)
            with self._lock:
                old, self.active = self.active, shadow.slot
                self._shadow.take()
                self.switches += 1
            log.info("shadow promoted", extra={"version": shadow.slot.version,
                                               "previous": old.version if old else None})
            if old is not None:
                old.retire()
            self._changed()
            return shadow.slot
        finally:
            self._reload_lock.release()

    def close(self) -> None:
        """No model serves after this, and none can be installed: a change still loading is discarded."""
        if self.auto is not None:
            self.auto.stop()
        with self._lock:
            self._closed = True
            slots = [s for s in (self.active, self.canary) if s is not None]
            shadow = self._shadow.take()
            if shadow is not None:
                slots.append(shadow.slot)
            self.active = self.canary = None
            self.state = "closed"
        for slot in slots:
            slot.retire()


def _bucket(key: str) -> float:
    """A stable number in [0, 1) for a routing key: the same key always lands on the same version."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
