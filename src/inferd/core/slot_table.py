"""A model's slot table: which loaded slots serve it (the active one, an optional canary and its share, an optional
shadow candidate), which slot a request runs on, and every slot loaded and not yet freed.

Routing reads the table on every request, so each read and each change of it is one short critical section under
the table's lock: a request sees a whole change or none of it. The table decides nothing about changes (which model
may serve, when, one change at a time: core/rollout.py); it records them, and refuses every install once it is
closed, so that nothing serves after shutdown. It never loads and never frees a model: the slots it gives back from
a change are the caller's to retire (core/slots.py frees a retired slot when its last request lets go).
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable
from typing import TypeAlias

from inferd.core.errors import ManagerClosed, ModelLoadError, ModelNotReady, NoCanary, VersionInUse
from inferd.core.loading import spec_task
from inferd.core.shadow import Shadow
from inferd.core.shadow_slot import ShadowSlot
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec

# Told when a slot is freed, and whether it was the last loaded slot of its version (then the version's labelled
# metric series can go).
OnFreed: TypeAlias = Callable[[ModelSlot, bool], None]

_DISCARDED = "the server is shutting down; the model change was discarded"


class SlotTable:
    """The slots one model serves and routes to; every change of them is atomic for requests."""

    def __init__(self, configured: ModelSpec, shadow: ShadowSlot, on_freed: OnFreed | None = None) -> None:
        self.configured = configured
        self._on_freed: OnFreed = on_freed or (lambda slot, last_of_version: None)
        # not_loaded, loading, ready, failed or closed; ``reason`` says why a load failed.
        self.state = "not_loaded"
        self.reason: str | None = None
        self.active: ModelSlot | None = None
        self.canary: ModelSlot | None = None
        self.canary_weight = 0.0
        # A candidate computing mirrored traffic beside the active model (core/shadow_slot.py); never answers.
        self._shadow = shadow
        self.switches = 0
        self.closed = False
        self._loaded: dict[int, ModelSlot] = {}  # loaded and not yet freed, by load_id
        # The configured model's task as its folder says (``task: auto``), read once: routing asks before a lazy
        # model's load, for every request, on the event loop (config.json and modules.json are files to read).
        self._configured_task: str | None = None
        self._lock = threading.Lock()

    # -- routing (every request) -------------------------------------------------------------------------

    def pick(self, routing_key: str | None = None, model: str | None = None) -> ModelSlot:
        """The slot this request runs on, with a reference taken (release it when the request ends): the version
        ``model`` pins, else the canary for its share of routing keys (or of draws), else the active one."""
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
                    slot = canary if _key_draw(routing_key) < self.canary_weight else active
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
        """The serving slots by role: the active one, then the canary (the shadow answers nobody: not listed)."""
        with self._lock:
            out = [("active", self.active)] if self.active else []
            if self.canary:
                out.append(("canary", self.canary))
            return out  # type: ignore[return-value]

    @property
    def task(self) -> str | None:
        """The task served: the loaded model's, or before a load the configured one (None: unknown yet)."""
        active = self.active
        if active is not None:
            return active.task
        if self._configured_task is None:
            try:
                self._configured_task = spec_task(self.configured)
            except ModelLoadError:
                return None  # not cached: the folder may yet be put right before the load
        return self._configured_task

    # -- the loaded slots ----------------------------------------------------------------------------------

    def register(self, slot: ModelSlot) -> None:
        """A slot just loaded: tracked until it is freed (``freed``, the slot's own callback)."""
        with self._lock:
            self._loaded[slot.load_id] = slot

    def freed(self, slot: ModelSlot) -> None:
        with self._lock:
            self._loaded.pop(slot.load_id, None)
            # A version can be loaded again while its old slot still drains; its series stay until both go.
            last = all(s.version != slot.version for s in self._loaded.values())
        self._on_freed(slot, last)

    def refuse_served_version(self, version: str) -> None:
        """A model change may not reuse the label of a model being served: two models would be one to
        clients (X-Model-Version, pinning), to metrics and to the cache."""
        with self._lock:
            shadow = self.shadow.slot if self.shadow is not None else None
            for role, slot in (("active", self.active), ("canary", self.canary), ("shadow", shadow)):
                if slot is not None and slot.version == version:
                    raise VersionInUse(version, role)

    # -- changes: each installs under the lock; once closed, nothing is installed ------------------------------

    def first_load_started(self) -> None:
        self.state = "loading"

    def first_load_failed(self, reason: str) -> None:
        """Nothing serves; ``reason`` is kept for /admin/models (public health only names the state)."""
        self.state, self.reason = "failed", reason

    def install_first(self, slot: ModelSlot, canary: ModelSlot | None, weight: float) -> bool:
        """The first load's slots; False when the table closed meanwhile (nothing installed)."""
        with self._lock:
            if self.closed:
                return False
            self.active = slot
            if canary is not None:
                self.canary, self.canary_weight = canary, weight
            self.state = "ready"
            return True

    def install_active(self, slot: ModelSlot) -> ModelSlot | None:
        """``slot`` serves instead of the active one, which it returns (to retire)."""
        with self._lock:
            self._refuse_closed()
            old, self.active = self.active, slot
            self.switches += 1
            # A reload after a failed start is how an operator recovers without a restart.
            self.state, self.reason = "ready", None
            self._shadow.active_changed()
            return old

    def install_canary(self, slot: ModelSlot, weight: float) -> ModelSlot | None:
        """``slot`` takes ``weight`` of the requests; returns the canary it replaces (to retire)."""
        with self._lock:
            self._refuse_closed()
            old, self.canary, self.canary_weight = self.canary, slot, weight
            return old

    def install_shadow(self, slot: ModelSlot, weight: float) -> Shadow | None:
        """``slot`` becomes the shadow candidate; returns the one it replaces (to retire)."""
        with self._lock:
            self._refuse_closed()
            return self._shadow.replace(slot, weight)

    def promote_canary(self) -> tuple[ModelSlot | None, ModelSlot]:
        """The canary becomes the active slot: (the old active, to retire; the new one)."""
        with self._lock:
            new = self.canary
            if new is None:
                raise NoCanary("there is no canary to promote")
            old, self.active, self.canary, self.canary_weight = self.active, new, None, 0.0
            self.switches += 1
            self._shadow.active_changed()  # its report compared with the old active: afresh, as after a reload
            return old, new

    def drop_canary(self) -> tuple[ModelSlot, ModelSlot | None]:
        """No canary any more: (the canary, to retire; the active slot)."""
        with self._lock:
            if self.canary is None:
                raise NoCanary("there is no canary to roll back")
            old, self.canary, self.canary_weight = self.canary, None, 0.0
            return old, self.active

    def take_shadow(self) -> Shadow | None:
        """No shadow candidate any more; returns the one there was."""
        with self._lock:
            return self._shadow.take()

    def promotable_shadow(self, force: bool, min_items: int) -> Shadow:
        """The shadow candidate if its drift report allows its promotion (or ``force``); else why not, raised.
        Judged outside the lock (the report's figures take their own); one change at a time holds it still."""
        with self._lock:
            canary = self.canary
        return self._shadow.promotable(canary, force, min_items)

    def promote_shadow(self, shadow: Shadow) -> ModelSlot | None:
        """``shadow``'s slot becomes the active one; returns the old active (to retire)."""
        with self._lock:
            old, self.active = self.active, shadow.slot
            self._shadow.take()
            self.switches += 1
            return old

    def close(self) -> list[ModelSlot]:
        """Nothing serves from now on and nothing can be installed; returns every slot that served (to retire)."""
        with self._lock:
            self.closed = True
            slots = [s for s in (self.active, self.canary) if s is not None]
            shadow = self._shadow.take()
            if shadow is not None:
                slots.append(shadow.slot)
            self.active = self.canary = None
            self.state = "closed"
        return slots

    def _refuse_closed(self) -> None:
        # close() already emptied the table; installing now would serve (and leak) a model after it.
        if self.closed:
            raise ManagerClosed(_DISCARDED)


def _key_draw(key: str) -> float:
    """A stable number in [0, 1) for a routing key: the same key always lands on the same version."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
