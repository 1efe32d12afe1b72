"""The ModelManager: one served model's slot table (core/slot_table.py: which slots serve, which one a request runs
on) and its rollout (core/rollout.py: how they change), built together and read as one.

It holds no state and decides nothing of its own: each member is the table's or the rollout's, named here so that
the engine, the routes and the admin API keep one handle on a model's slots.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from inferd.core.backends.auto import AutoUpgrade
from inferd.core.load_guard import LoadGuard
from inferd.core.loading import load_handler
from inferd.core.rollout import OnChange, Rollout
from inferd.core.shadow import MIN_ITEMS, Shadow
from inferd.core.shadow_slot import ShadowSlot
from inferd.core.slot_loader import Loader, SlotLoader
from inferd.core.slot_table import OnFreed, SlotTable
from inferd.core.slots import ModelSlot, PostToWorker
from inferd.core.spec import spec_from_settings
from inferd.settings import Settings


class ModelManager:
    """A model's slot table and its rollout."""

    def __init__(self, settings: Settings, loader: Loader = load_handler, *,
                 on_change: OnChange | None = None,
                 post_to_worker: PostToWorker | None = None,
                 on_freed: OnFreed | None = None,
                 on_lazy_failure: Callable[[str], None] | None = None) -> None:
        """``post_to_worker``: where slots are freed and a canary's space is checked (the engine's worker thread;
        None: the calling thread); ``on_freed``: told each freed slot and whether its version is gone."""
        self.settings = settings
        self.table = SlotTable(spec_from_settings(settings), ShadowSlot(settings), on_freed)
        self.slot_loader = SlotLoader(settings, self.table, loader, post_to_worker)
        self.rollout = Rollout(settings, self.table, self.slot_loader, on_change=on_change,
                               on_lazy_failure=on_lazy_failure)

    # -- the slot table: routing and what serves ----------------------------------------------------------

    def pick(self, routing_key: str | None = None, model: str | None = None) -> ModelSlot:
        return self.table.pick(routing_key, model)

    def pick_shadow(self, routing_key: str | None, draw: float) -> Shadow | None:
        return self.table.pick_shadow(routing_key, draw)

    def slots(self) -> list[tuple[str, ModelSlot]]:
        return self.table.slots()

    @property
    def task(self) -> str | None:
        return self.table.task

    @property
    def state(self) -> str:
        return self.table.state

    @property
    def reason(self) -> str | None:
        return self.table.reason

    @property
    def active(self) -> ModelSlot | None:
        return self.table.active

    @property
    def canary(self) -> ModelSlot | None:
        return self.table.canary

    @property
    def canary_weight(self) -> float:
        return self.table.canary_weight

    @property
    def shadow(self) -> Shadow | None:
        return self.table.shadow

    @property
    def switches(self) -> int:
        return self.table.switches

    # -- the rollout: changes ---------------------------------------------------------------------------------

    def load_initial(self) -> None:
        self.rollout.load_initial()

    async def ensure_loaded(self) -> None:
        await self.rollout.ensure_loaded()

    def reload(self, path: str, version: str, runtime: dict[str, str] | None = None) -> ModelSlot:
        return self.rollout.reload(path, version, runtime)

    def reload_from_settings(self, settings: Settings) -> ModelSlot:
        return self.rollout.reload_from_settings(settings)

    def canary_from_settings(self, settings: Settings) -> ModelSlot | None:
        return self.rollout.canary_from_settings(settings)

    def follow(self, settings: Settings) -> None:
        """SIGHUP: the model's sections as it took them, read by its later loads and changes (model.root,
        allow_dimension_change, load_timeout_s...)."""
        self.settings = settings
        self.slot_loader.settings = settings
        self.rollout.follow(settings)

    def set_canary(self, path: str, version: str, weight: float,
                   runtime: dict[str, str] | None = None, force: bool = False) -> ModelSlot:
        return self.rollout.set_canary(path, version, weight, runtime, force)

    def promote(self) -> ModelSlot:
        return self.rollout.promote()

    def rollback(self) -> ModelSlot:
        return self.rollout.rollback()

    def set_shadow(self, path: str, version: str, weight: float,
                   runtime: dict[str, str] | None = None) -> ModelSlot:
        return self.rollout.set_shadow(path, version, weight, runtime)

    def drop_shadow(self) -> Shadow:
        return self.rollout.drop_shadow()

    def promote_shadow(self, force: bool = False, min_items: int = MIN_ITEMS) -> ModelSlot:
        return self.rollout.promote_shadow(force, min_items)

    @property
    def loading(self) -> LoadGuard | None:
        return self.rollout.loading

    def cancel_load(self, reason: str = "cancelled through the admin API") -> LoadGuard:
        return self.rollout.cancel_load(reason)

    def close(self) -> None:
        self.rollout.close()

    @property
    def auto(self) -> AutoUpgrade | None:
        return self.rollout.auto

    @property
    def roots(self) -> list[Path]:
        return self.rollout.roots
