"""A model's rollout: how the slots that serve it change under traffic (the first load, a reload, a canary set,
promoted or rolled back, a shadow set, dropped or promoted, backend auto's switch to a faster runtime).

A change loads the new model beside the serving one (core/slot_loader.py), installs it in the slot table in one
step (core/slot_table.py: atomic for every new request) and retires the slot it replaces, freed when its last
request lets go (core/slots.py). A failed load, or a model the task's own rule refuses, leaves the serving model in
place. Changes run one at a time (core/change_lock.py); one that loads is bounded by ``model.load_timeout_s`` and
cancellable (``cancel_load``, core/load_guard.py). Once closed, nothing more is installed: a change still loading
then discards its model.

A SIGHUP changes the model (``reload_from_settings``) and its canary (``canary_from_settings``) as freshly read
settings say; the rules of later changes (``model.root``, ``allow_dimension_change``, ``load_timeout_s``) are read
from ``settings`` when a change runs, so they follow the settings the model last took (``follow``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias, TypeVar

from inferd.core import load_guard
from inferd.core.backends.auto import (
    AutoUpgrade,
    ModelChangeBusy,
    by_name,
    earlier_verdicts,
    not_judged,
    remember,
    remembered,
)
from inferd.core.change_lock import ChangeLock
from inferd.core.errors import ManagerClosed, ModelLoadError, ModelNotReady, NoShadow, ReloadInProgress, SpaceChanged
from inferd.core.load_guard import LoadGuard
from inferd.core.loading import check_model_path
from inferd.core.shadow import MIN_ITEMS, Shadow
from inferd.core.slot_loader import SlotLoader, refusal
from inferd.core.slot_table import SlotTable
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec, spec_from_settings
from inferd.core.tasks.embedding import allows_change
from inferd.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

# Told the served slots after every change (the app publishes them as metrics).
OnChange: TypeAlias = Callable[[list[tuple[str, ModelSlot]]], None]


class Rollout:
    """The changes of one model's slots, one at a time, each installed atomically in its slot table."""

    def __init__(self, settings: Settings, table: SlotTable, slot_loader: SlotLoader, *,
                 on_change: OnChange | None = None,
                 on_lazy_failure: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.table = table
        self.slot_loader = slot_loader
        self._on_change: OnChange = on_change or (lambda slots: None)
        # Told when a lazy first load fails (the app exits there if model.exit_on_load_failure is set).
        self._on_lazy_failure: Callable[[str], None] = on_lazy_failure or (lambda reason: None)
        # backend auto: the background judge of faster runtimes for the active load (core/backends/auto.py).
        self.auto = AutoUpgrade(settings.model.auto_candidates) if settings.model.backend == "auto" else None
        self.change_lock = ChangeLock(settings.model.load_timeout_s)
        self._lazy_lock = asyncio.Lock()

    def follow(self, settings: Settings) -> None:
        """Later changes read these settings (a SIGHUP's, once the model took them): its roots, its consent to a
        dimension change, its load bound (``model.backend: auto`` and its candidates follow with the reload that
        takes them: ``_follow_auto``)."""
        self.settings = settings
        self.change_lock.timeout_s = settings.model.load_timeout_s

    @property
    def roots(self) -> list[Path]:
        """Where a client's load may come from (model.root; default: the configured model's parent folder)."""
        roots = [Path(r).expanduser().resolve() for r in self.settings.model.root]
        return roots or [self.table.configured.path.expanduser().resolve().parent]

    # -- the first load ------------------------------------------------------------------------------------

    def load_initial(self) -> None:
        """Load the configured model (and canary) and install them; a failure is recorded in the table (state
        failed, and why), then raised."""
        table = self.table
        table.first_load_started()
        try:
            slot = self._first_load()
            try:
                canary = self._configured_canary(slot)
            except ModelLoadError:
                slot.retire()
                raise
        except ModelLoadError as exc:
            table.first_load_failed(str(exc))
            log.error("model load failed: %s", exc)
            raise
        if not table.install_first(slot, canary, self.settings.canary.weight):
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

    def _configured_canary(self, active: ModelSlot) -> ModelSlot | None:
        """``canary.path`` loaded beside the first model and held to a canary's rules (its task's, a version of its
        own, its vectors' space unless ``canary.force``); None when no canary is configured."""
        c = self.settings.canary
        if not (c.path and c.weight > 0):
            return None
        canary = self.slot_loader.load(spec_from_settings(self.settings, Path(c.path), c.version or "canary"))
        try:
            # Consent to a dimension change given: another size is another space, the check below with canary.force.
            why = refusal(canary, active, True)
            if why is not None:
                raise ModelLoadError(f"canary.path {c.path}: {why}")
            if canary.version == active.version:
                raise ModelLoadError(f"canary.version {canary.version!r} is the model's own version; "
                                     "give the canary its own")
            space = self.slot_loader.space_changed(canary, active)
            if space is not None and not c.force:
                raise ModelLoadError(f"canary.path {c.path}: {space} (canary.force: true at start)")
        except ModelLoadError:
            canary.retire()
            raise
        if space is not None:
            log.warning("canary forced although its space differs: %s", space, extra={"version": canary.version})
        return canary

    def _first_load(self) -> ModelSlot:
        """The configured model; under backend auto, on the runtime a previous start chose for it where the cache
        still holds it (a warm start: no torch first, nothing judged again), else on torch."""
        configured = self.table.configured
        name = remembered(configured) if self.auto is not None and configured.backend == "auto" else None
        if name is not None and self.auto is not None:
            try:
                slot = self.slot_loader.load(dataclasses.replace(configured, **by_name(name).runtime()))
            except ModelLoadError as exc:
                log.warning("backend auto: the cached choice %s did not load (%s); starting on torch", name, exc)
            else:
                self.auto.adopt(name, "chosen by an earlier start on this machine (its cache entry, judged again)",
                                earlier_verdicts(configured))
                log.info("backend auto: serving %s at once, as an earlier start on this machine chose", name)
                return slot
        return self.slot_loader.load(configured)

    async def ensure_loaded(self) -> None:
        """Lazy mode: the first request loads the model, exactly once however many arrive together."""
        if self.table.state == "ready":
            return
        async with self._lazy_lock:
            if self.table.state in ("not_loaded",):
                try:
                    await asyncio.to_thread(self.load_initial)
                except ModelLoadError as exc:
                    self._on_lazy_failure(str(exc))
        if self.table.state != "ready":
            raise ModelNotReady(self.table.state, self.table.reason)

    def _changed(self) -> None:
        self._on_change(self.table.slots())

    # -- installing a loaded slot ---------------------------------------------------------------------------

    def _install(self, slot: ModelSlot, put: Callable[[], T]) -> T:
        """The guarded change installs ``slot`` now (``put``); abandoned first, or refused by a closed table, the
        slot is freed and the change raises."""
        try:
            load_guard.commit()
        except ModelLoadError:
            slot.retire()
            raise
        try:
            return put()
        except ManagerClosed:
            slot.retire()
            log.info("a model change finished after shutdown began; its model was released, nothing switched",
                     extra={"version": slot.version})
            raise

    def _switch(self, slot: ModelSlot) -> None:
        old = self._install(slot, lambda: self.table.install_active(slot))
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

    # -- changes that load a model ---------------------------------------------------------------------------

    def switch_runtime(self, base: ModelSlot, runtime: dict[str, str]) -> ModelSlot:
        """backend auto: serve ``base``'s folder and version on another runtime, loaded beside it and swapped in as a
        reload is (core/backends/auto.py). Refused once ``base`` no longer serves (a reload came first)."""
        def serving() -> None:
            if self.table.active is not base:
                raise ModelLoadError("the model changed while backend auto judged a faster runtime for it")

        def work() -> ModelSlot:
            serving()
            slot = self.slot_loader.load(dataclasses.replace(base.spec, **runtime))
            try:
                serving()
            except ModelLoadError:
                slot.retire()
                raise
            self._switch(slot)
            d = slot.description
            others = not_judged(self.auto.verdicts, d.runtime) if self.auto is not None else []
            remember(base.spec, d.runtime, (d.backend_info or {}).get("cache_entry"), others)
            return slot

        try:
            return self.change_lock.run_loading("auto", work)
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
            slot = self.slot_loader.load_standby(self._client_spec(path, version, runtime))
            self._switch(slot)
            return slot

        return self.change_lock.run_loading("reload", work)

    def reload_from_settings(self, settings: Settings) -> ModelSlot:
        """SIGHUP: serve the model section of freshly read settings (path, version, pooling, task...).

        The configuration is the operator's own, like the path the server started with, so it is not held
        to ``model.root``; the task's compatibility rule still applies, by the new configuration's consent, and so does
        the version rule (a new model needs a new ``model.version``).
        """
        def work() -> ModelSlot:
            slot = self.slot_loader.load_standby(spec_from_settings(settings), allows_change(settings.model))
            self._follow_auto(settings)
            self._switch(slot)
            return slot

        return self.change_lock.run_loading("reload", work, settings.model.load_timeout_s)

    def _follow_auto(self, settings: Settings) -> None:
        """A reload's model section turns ``backend: auto`` on or off, or names other candidates: the judge is the
        section's (the switch that follows starts it on the new load; a judging of the old one ends)."""
        wanted = tuple(settings.model.auto_candidates) if settings.model.backend == "auto" else None
        if wanted == (None if self.auto is None else self.auto.wanted):
            return
        if self.auto is not None:
            self.auto.stop()
        self.auto = None if wanted is None else AutoUpgrade(wanted)

    def _require_serving(self) -> None:
        # A canary or a shadow is measured against the active model: there must be one (unless closing, where
        # the load's own refusal says so).
        if self.table.active is None and not self.table.closed:
            raise ModelNotReady(self.table.state, self.table.reason)

    def set_canary(self, path: str, version: str, weight: float,
                   runtime: dict[str, str] | None = None, force: bool = False) -> ModelSlot:
        """Load a canary beside the active model that takes ``weight`` of the requests; one whose vectors are
        not the active model's space (another size included) is refused unless ``force``."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"canary weight must lie in [0, 1], not {weight}")

        def work() -> ModelSlot:
            self._require_serving()
            # allow_change: a canary's size is the space check's to judge, which force overrides (not the reload's
            # dimension rule, whose refusal no force could lift); the task's other rules (labels) still apply.
            slot = self.slot_loader.load_standby(self._client_spec(path, version, runtime), allow_change=True)
            return self._put_canary(slot, weight, force)

        return self.change_lock.run_loading("canary", work)

    def canary_from_settings(self, settings: Settings) -> ModelSlot | None:
        """SIGHUP: serve the canary section of freshly read settings. A new path or version is loaded and replaces
        the canary (held to a configured canary's rules: its task's, a version of its own, its space unless
        ``canary.force``; not to ``model.root``, the configuration being the operator's own); the canary it already
        names takes its new weight, nothing loaded; none named (no path, or weight 0) drops the canary. Before the
        first load nothing is done: that load reads the canary from the settings the model follows. Returns the
        canary served after (None: none)."""
        c = settings.canary
        if self.table.state == "not_loaded":
            return None
        if not (c.path and c.weight > 0):
            with self.change_lock.held():
                if self.table.canary is None:
                    return None
                old, _ = self.table.drop_canary()
                log.info("canary dropped: the configuration names none", extra={"version": old.version})
                old.retire()
                self._changed()
                return None
        path, version = Path(c.path), c.version or "canary"
        with self.change_lock.held():
            serving = self.table.canary
            if serving is not None and serving.version == version and serving.spec.path == path:
                self.table.install_canary(serving, c.weight)  # itself replaced: nothing to retire
                log.info("canary weight changed", extra={"version": version, "weight": c.weight})
                return serving

        def work() -> ModelSlot:
            self._require_serving()
            slot = self.slot_loader.load_standby(spec_from_settings(settings, path, version), allow_change=True)
            return self._put_canary(slot, c.weight, c.force, f"canary.path {c.path}: ")

        return self.change_lock.run_loading("canary", work, settings.model.load_timeout_s)

    def _put_canary(self, slot: ModelSlot, weight: float, force: bool, where: str = "") -> ModelSlot:
        """Install a loaded canary once its space is the active model's (or ``force``); the one it replaces goes."""
        why = self.slot_loader.space_changed(slot)
        if why is not None and not force:
            slot.retire()
            raise SpaceChanged(where + why)
        if why is not None:
            log.warning("canary forced although its space differs: %s", why, extra={"version": slot.version})
        old = self._install(slot, lambda: self.table.install_canary(slot, weight))
        log.info("canary set", extra={"version": slot.version, "weight": weight})
        if old is not None:
            old.retire()
        self._changed()
        return slot

    def set_shadow(self, path: str, version: str, weight: float,
                   runtime: dict[str, str] | None = None) -> ModelSlot:
        """Load a candidate beside the active model (the checks of a canary) that computes ``weight`` of the
        live requests off the response path; a previous candidate and its report are replaced."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"shadow weight must lie in [0, 1], not {weight}")

        def work() -> ModelSlot:
            self._require_serving()
            slot = self.slot_loader.load_standby(self._client_spec(path, version, runtime))
            old = self._install(slot, lambda: self.table.install_shadow(slot, weight))
            log.info("shadow set", extra={"version": slot.version, "weight": weight})
            if old is not None:
                old.slot.retire()
            return slot

        return self.change_lock.run_loading("shadow", work)

    @property
    def loading(self) -> LoadGuard | None:
        """The model change loading now, if any (its action, stage and age)."""
        return self.change_lock.loading

    def cancel_load(self, reason: str = "cancelled through the admin API") -> LoadGuard:
        """Abandon the model change loading now: the serving model stays, the change lock is free at once, and
        the load stops at its next stage (core/load_guard.py). NoLoadInProgress when none is (or it has just
        installed its model)."""
        return self.change_lock.cancel(reason)

    # -- changes that load nothing ----------------------------------------------------------------------------

    def promote(self) -> ModelSlot:
        """The canary becomes the active model; the old active is retired."""
        with self.change_lock.held():
            old, new = self.table.promote_canary()
            log.info("canary promoted", extra={"version": new.version, "previous": old.version if old else None})
            if old is not None:
                old.retire()
            self._changed()
            return new

    def rollback(self) -> ModelSlot:
        """Drop the canary; all traffic returns to the active model."""
        with self.change_lock.held():
            old, active = self.table.drop_canary()
            log.info("canary rolled back", extra={"version": old.version})
            old.retire()
            self._changed()
            return active  # type: ignore[return-value]

    def drop_shadow(self) -> Shadow:
        """Stop shadowing; the candidate is freed once its queued work lets go. Returns it (its final report)."""
        with self.change_lock.held():
            old = self.table.take_shadow()
            if old is None:
                raise NoShadow("there is no shadow candidate")
            log.info("shadow dropped", extra={"version": old.slot.version})
            old.slot.retire()
            return old

    def promote_shadow(self, force: bool = False, min_items: int = MIN_ITEMS) -> ModelSlot:
        """The shadow candidate becomes the active model when its drift report allows it (or ``force``)."""
        with self.change_lock.held():
            shadow = self.table.promotable_shadow(force, min_items)
            old = self.table.promote_shadow(shadow)
            log.info("shadow promoted", extra={"version": shadow.slot.version,
                                               "previous": old.version if old else None})
            if old is not None:
                old.retire()
            self._changed()
            return shadow.slot

    def close(self) -> None:
        """No model serves after this, and none can be installed: a change still loading is discarded."""
        if self.auto is not None:
            self.auto.stop()
        for slot in self.table.close():
            slot.retire()
