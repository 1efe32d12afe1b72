"""One model change's load, bounded: cancelled by the admin API, or abandoned past ``model.load_timeout_s``.

A load runs in a thread, and a thread cannot be killed: so the change runs in a thread of its own while the
caller waits for it, the admin's cancel or the timeout, whichever comes first. On a cancel or a timeout the caller
answers at once and the manager frees its change lock (other changes proceed, the serving model is unchanged);
the abandoned load stops at its next stage (``stage``: before reading the weights, after building the model,
before and after its warm-up, before its slot is installed) and frees what it built. Between two stages it
runs on: one stage is the granularity, and transformers' own build of a model is one stage. That is why a
folder's config is held to its checkpoint before anything is built (core/checkpoint.py): the build that could
run away is refused, and the timeout guards the rest (a slow export, a slow device).

``commit`` is where a change becomes visible (its slot installed): after it a cancel is refused, before it
the change is abandoned; the two are decided under the guard's lock, so a change is either installed and
answered, or cancelled and never installed.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from inferd.core.errors import LoadCancelled, LoadTimedOut, ModelLoadError

T = TypeVar("T")

_current: contextvars.ContextVar[LoadGuard | None] = contextvars.ContextVar("inferd_load_guard", default=None)


class LoadGuard:
    """The state of one model change's load: its stage, and whether it was cancelled (and why) or committed."""

    def __init__(self, action: str, timeout_s: float | None = None) -> None:
        self.action = action
        self.timeout_s = timeout_s or None
        self.started = time.monotonic()
        self.stage = "starting"
        self.reason: str | None = None
        self._timed_out = False
        self._committed = False
        self._cancelled = threading.Event()
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def cancel(self, reason: str, timed_out: bool = False) -> bool:
        """Abandon the load; False when it has already committed (its change is done, nothing to cancel)."""
        with self._lock:
            if self._committed:
                return False
            if not self._cancelled.is_set():
                self.reason, self._timed_out = reason, timed_out
                self._cancelled.set()
            return True

    def error(self) -> ModelLoadError:
        kind = LoadTimedOut if self._timed_out else LoadCancelled
        return kind(f"the {self.action} was abandoned at its stage '{self.stage}' after {self.seconds:.1f} s: "
                    f"{self.reason}")

    def check(self, stage: str) -> None:
        """Entering ``stage``: stop here (LoadCancelled / LoadTimedOut) if the load was abandoned."""
        self.stage = stage
        if self._cancelled.is_set():
            raise self.error()

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, cut short (and raised) by a cancel."""
        if self._cancelled.wait(seconds):
            raise self.error()

    def commit(self) -> None:
        """The change becomes visible now: refused (raised) if it was abandoned; a later cancel is refused."""
        with self._lock:
            if self._cancelled.is_set():
                raise self.error()
            self._committed = True
            self.stage = "installed"

    def describe(self) -> dict[str, object]:
        return {"action": self.action, "stage": self.stage, "seconds": round(self.seconds, 3),
                "timeout_s": self.timeout_s, "cancelled": self.cancelled}


def current() -> LoadGuard | None:
    return _current.get()


def stage(name: str) -> None:
    """A point between a load's stages where an abandoned load stops; nothing outside a guarded change."""
    guard = _current.get()
    if guard is not None:
        guard.check(name)


def sleep(seconds: float) -> None:
    """``time.sleep`` that a cancel of the guarded change cuts short."""
    guard = _current.get()
    if guard is None:
        time.sleep(seconds)
    else:
        guard.sleep(seconds)


def commit() -> None:
    """The guarded change (if any) installs its slot now; raises if it was abandoned first."""
    guard = _current.get()
    if guard is not None:
        guard.commit()


def guarded(guard: LoadGuard, work: Callable[[], T]) -> T:
    """Run ``work`` under ``guard`` in a thread of its own; answer its result, or raise as soon as the guard is
    cancelled or its timeout passes (the work, abandoned, stops at its next stage)."""
    done = threading.Event()
    box: dict[str, object] = {}

    def body() -> None:
        _current.set(guard)
        try:
            box["result"] = work()
        except BaseException as exc:  # handed to the waiting caller, whatever it is
            box["error"] = exc
        finally:
            done.set()

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(body,), name=f"inferd-{guard.action}", daemon=True).start()
    deadline = None if guard.timeout_s is None else guard.started + guard.timeout_s
    while not done.is_set():
        if guard.cancelled:
            raise guard.error()
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            if guard.cancel(f"it ran past model.load_timeout_s ({guard.timeout_s:g} s)", timed_out=True):
                raise guard.error()
            done.wait()  # committed just now: its change is installed, and its answer comes in a moment
            break
        # Short waits: a cancel is seen within a tenth of a second without a second event to wait on.
        done.wait(0.1 if left is None else min(0.1, left))
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
