"""One model change at a time: the lock a change of a model's slots holds, and the change loading now.

A change that loads a model (a reload, a canary, a shadow, backend auto's switch) runs under a load guard
(core/load_guard.py): bounded by ``model.load_timeout_s`` and cancellable through the admin API. Either ends it at
once for its caller and frees the lock here, so the next change may start while the abandoned load winds down at
its next stage. A change that loads nothing (a promotion, a rollback, a shadow dropped) only holds the lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from inferd.core import load_guard
from inferd.core.errors import NoLoadInProgress, ReloadInProgress
from inferd.core.load_guard import LoadGuard

log = logging.getLogger(__name__)

T = TypeVar("T")


class ChangeLock:
    """Held by the one change of a model's slots in progress; knows the change loading now, if any."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s  # model.load_timeout_s: a loading change's default bound
        self._held = threading.Lock()
        # The change loading now (None: none), which the admin API may cancel.
        self._loading: LoadGuard | None = None
        self._lock = threading.Lock()  # guards ``_loading``: a change's end and its cancel race for it

    def take(self) -> None:
        """Hold the lock, or refuse (ReloadInProgress) while another change holds it: changes never queue."""
        if not self._held.acquire(blocking=False):
            raise ReloadInProgress("another model change is in progress")

    def release(self) -> None:
        self._held.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A change that loads nothing, under the lock."""
        self.take()
        try:
            yield
        finally:
            self.release()

    def run_loading(self, action: str, work: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run a change that loads a model under the lock and a load guard of its own (``timeout_s``: the bound;
        None: model.load_timeout_s); a cancel or the bound ends it at once for the caller and frees the lock."""
        self.take()
        guard = LoadGuard(action, self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            self._loading = guard
        try:
            return load_guard.guarded(guard, work)
        finally:
            with self._lock:
                mine = self._loading is guard  # else cancel took the lock's release upon itself
                if mine:
                    self._loading = None
            if mine:
                self.release()

    @property
    def loading(self) -> LoadGuard | None:
        """The model change loading now, if any (its action, stage and age)."""
        return self._loading

    def cancel(self, reason: str) -> LoadGuard:
        """Abandon the change loading now: the lock is free at once and the load stops at its next stage.
        NoLoadInProgress when none is (or it has just installed its model)."""
        with self._lock:
            guard = self._loading
            if guard is None or not guard.cancel(reason):
                raise NoLoadInProgress("no model change is loading (none started, or it has just finished)")
            self._loading = None
        self.release()
        log.warning("model change cancelled", extra={"action": guard.action, "stage": guard.stage,
                                                      "seconds": round(guard.seconds, 3)})
        return guard
