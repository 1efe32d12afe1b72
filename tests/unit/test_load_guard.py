"""A model change's load, bounded (core/load_guard.py, issue 39 item 1): cancelled through the manager (the admin
API's cancel) or abandoned past model.load_timeout_s, the serving model unchanged, the change lock free at once,
and the abandoned load's model never installed and freed when it stops. The loads are fakes that block where a
test says: inside the loader (a build no check can interrupt) or in model.load_delay_s (a cooperative wait)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from fakes import FakeHandler
from settingskit import make_settings

from inferd.core import load_guard
from inferd.core.errors import LoadCancelled, LoadTimedOut, NoLoadInProgress, ReloadInProgress
from inferd.core.load_guard import LoadGuard
from inferd.core.manager import ModelManager
from inferd.core.spec import ModelSpec


class Loader:
    """Loads of folders named ``slow*`` block until the test opens ``gate``, uninterruptibly (a thread in
    transformers' build); then the load goes on to its next stage, as load_handler's would."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.handlers: list[FakeHandler] = []
        self.finished = threading.Event()

    def __call__(self, spec: ModelSpec) -> FakeHandler:
        handler = FakeHandler(spec)
        self.handlers.append(handler)
        if spec.path.name.startswith("slow"):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
            self.finished.set()
        return handler


def manager_for(tmp_path: Path, loader: Loader, **model: Any) -> ModelManager:
    settings = make_settings(layered="dev", model={"path": str(tmp_path / "m1"), "version": "v1", "name": "tiny",
                                                   "root": [str(tmp_path)], **model})
    m = ModelManager(settings, loader)
    m.load_initial()
    return m


def served(manager: ModelManager) -> str:
    slot = manager.pick()
    slot.release()
    return slot.version


def reload_in_thread(manager: ModelManager, path: Path, version: str) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["slot"] = manager.reload(str(path), version)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_cancelled_load_answers_at_once_frees_the_lock_and_never_installs(tmp_path: Path) -> None:
    loader = Loader()
    manager = manager_for(tmp_path, loader)
    thread, out = reload_in_thread(manager, tmp_path / "slow", "v2")
    assert loader.entered.wait(10)
    assert manager.loading is not None and manager.loading.action == "reload"
    with pytest.raises(ReloadInProgress):
        manager.reload(str(tmp_path / "m3"), "v3")

    guard = manager.cancel_load()

    # The reload answers while its load is still stuck in the loader: it does not wait for it.
    thread.join(10)
    assert not thread.is_alive() and not loader.finished.is_set()
    assert isinstance(out["error"], LoadCancelled) and "cancelled through the admin API" in str(out["error"])
    assert guard.cancelled and manager.loading is None
    assert served(manager) == "v1" and manager.switches == 0
    # The lock is free: the next change proceeds while the abandoned load still runs.
    manager.reload(str(tmp_path / "m3"), "v3")
    assert served(manager) == "v3"
    # The abandoned load finishes its build: it stops at its next stage, and what it built is freed.
    abandoned = loader.handlers[1]
    loader.gate.set()
    assert loader.finished.wait(10)
    wait_for(lambda: abandoned.closed, what="the abandoned load's model freed")
    assert served(manager) == "v3" and manager.switches == 1


def test_a_load_past_load_timeout_s_is_abandoned_and_answered(tmp_path: Path) -> None:
    loader = Loader()
    manager = manager_for(tmp_path, loader, load_timeout_s=0.3)
    with pytest.raises(LoadTimedOut, match=r"ran past model.load_timeout_s \(0.3 s\)") as caught:
        manager.reload(str(tmp_path / "slow"), "v2")
    assert caught.value.code == "load_timed_out" and caught.value.field == "path"
    assert served(manager) == "v1" and manager.loading is None
    manager.reload(str(tmp_path / "m3"), "v3")  # the lock was released by the timeout
    assert served(manager) == "v3"
    loader.gate.set()


def test_a_cancel_cuts_the_load_delay_short(tmp_path: Path) -> None:
    """model.load_delay_s (the tests' slow load) waits on the guard: a cancel ends the load itself at once."""
    loader = Loader()
    manager = manager_for(tmp_path, loader)
    slow = manager.slot_loader.settings.model.model_copy(update={"load_delay_s": 60.0})
    # After the first load: the loads of changes only.
    manager.slot_loader.settings = manager.slot_loader.settings.model_copy(update={"model": slow})
    thread, out = reload_in_thread(manager, tmp_path / "m2", "v2")
    wait_for(lambda: manager.loading is not None, what="the reload under way")
    manager.cancel_load()
    thread.join(10)
    assert isinstance(out["error"], LoadCancelled)
    assert len(loader.handlers) == 1  # the loader was never reached: the delay raised
    assert served(manager) == "v1"


def test_a_cancel_with_no_load_in_progress_is_a_conflict(tmp_path: Path) -> None:
    manager = manager_for(tmp_path, Loader())
    with pytest.raises(NoLoadInProgress) as caught:
        manager.cancel_load()
    assert caught.value.code == "no_load_in_progress"


def test_a_committed_change_cannot_be_cancelled_and_a_cancelled_one_cannot_commit() -> None:
    done = LoadGuard("reload")
    done.commit()
    assert not done.cancel("too late") and not done.cancelled
    gone = LoadGuard("reload")
    assert gone.cancel("cancelled")
    with pytest.raises(LoadCancelled):
        gone.commit()
    with pytest.raises(LoadCancelled, match="at its stage 'building the model'"):
        gone.check("building the model")


def test_stages_are_free_outside_a_guarded_change() -> None:
    load_guard.stage("anything")  # the first load at start, `inferd export`: nothing to cancel, nothing raised
    load_guard.commit()
    assert load_guard.current() is None
