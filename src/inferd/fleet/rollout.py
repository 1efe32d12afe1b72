"""Model changes reach every worker, or none: one worker at a time through its admin API, undone on refusal.

Before changing anything every worker must answer ``GET /admin/models`` with a model serving (what it serves
is kept, to undo to). Then each worker in turn gets the change; if one refuses (an error answer, or no answer),
the workers already changed are put back as they were, newest first, and ``ChangeFailed`` names the worker and
the cause. When all have changed, the workers' configuration in the run folder is rewritten, so a worker that
supervisord restarts later starts on what the others serve.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from inferd.fleet.control import RunDir, models
from inferd.fleet.layout import WorkerSlot
from inferd.fleet.worker_config import read_worker_config, write_worker_config

ACTIONS = ("reload", "canary", "promote", "rollback")


class ChangeFailed(Exception):
    """One worker refused; ``restored`` were put back, ``mixed`` could not be (name, cause)."""

    def __init__(self, message: str, worker: str | None, restored: list[str],
                 mixed: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.worker, self.restored, self.mixed = worker, restored, mixed


@dataclass(frozen=True)
class Change:
    action: str
    path: str | None = None
    version: str | None = None
    weight: float | None = None
    # The served model it changes (None: the workers' only model).
    model: str | None = None
    # canary: even an embedding model of another space (refused by default: see "Changing a model safely").
    force: bool = False

    def body(self) -> dict[str, Any] | None:
        named = {"model": self.model} if self.model else {}
        if self.action == "reload":
            return {**named, "path": self.path, "version": self.version}
        if self.action == "canary":
            forced = {"force": True} if self.force else {}
            return {**named, "path": self.path, "version": self.version, "weight": self.weight, **forced}
        return None


def _slot(before: dict[str, Any], role: str) -> dict[str, Any] | None:
    return next((s for s in before.get("slots", []) if s["role"] == role), None)


def _cause(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        r = exc.response
        try:
            err = r.json()["error"]
            return f"{r.status_code} {err['code']}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            return f"{r.status_code}: {r.text[:300]}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Rollout:
    def __init__(self, run: RunDir, client: httpx.Client, say: Callable[[str], None] = lambda _: None) -> None:
        self.run, self.client, self.say = run, client, say
        self.key = run.admin_key

    def _post(self, w: WorkerSlot, route: str, body: dict[str, Any] | None = None,
              model: str | None = None) -> dict[str, Any]:
        # promote and rollback name the model in the query (they have no body).
        params = {"model": model} if model and body is None else None
        r = self.client.post(f"{w.admin_url}/admin/models/{route}", json=body, params=params,
                             headers={"Authorization": f"Bearer {self.key}"})
        r.raise_for_status()
        return r.json()

    def _undo(self, w: WorkerSlot, change: Change, before: dict[str, Any]) -> None:
        """Put one worker back as ``before`` (its GET /admin/models answer for the model) says it was."""
        active, canary = _slot(before, "active"), _slot(before, "canary")
        named = {"model": change.model} if change.model else {}
        if change.action in ("reload", "promote") and active is not None:
            self._post(w, "reload", {**named, "path": active["path"], "version": active["version"]})
        if change.action in ("canary", "promote", "rollback"):
            if canary is not None:
                # It served before: put back as it was, whatever its space (it may have been forced).
                self._post(w, "canary", {**named, "path": canary["path"], "version": canary["version"],
                                         "weight": before.get("canary_weight", 0.0), "force": True})
            elif change.action == "canary":
                self._post(w, "rollback", model=change.model)

    def apply(self, change: Change) -> list[dict[str, Any]]:
        """Change every worker, or none; returns each worker's answer. Raises ChangeFailed."""
        workers = self.run.layout.workers
        befores: dict[str, dict[str, Any]] = {}
        for w in workers:
            try:
                befores[w.name] = data = models(self.client, w, self.key, change.model)
            except (httpx.HTTPError, ValueError) as exc:
                raise ChangeFailed(f"{w.name} ({w.admin_url}) did not answer GET /admin/models: {_cause(exc)}; "
                                   "no worker was changed", w.name, [], []) from None
            if data.get("state") != "ready":
                which = f"model {change.model} " if change.model else ""
                raise ChangeFailed(f"{w.name} is not serving {which}(state {data.get('state')}); no worker was "
                                   "changed", w.name, [], [])
        done: list[WorkerSlot] = []
        answers = []
        for w in workers:
            try:
                answers.append(self._post(w, change.action, change.body(), change.model))
            except (httpx.HTTPError, ValueError) as exc:
                cause = _cause(exc)
                self.say(f"{w.name} refused the {change.action}: {cause}; undoing it on {len(done)} worker(s)")
                restored, mixed = self._undo_all(done, change, befores)
                raise ChangeFailed(self._failure(w, change, cause, restored, mixed), w.name, restored,
                                   mixed) from None
            done.append(w)
            self.say(f"{w.name}: {change.action} done")
        self._persist(change, answers)
        return answers

    def _undo_all(self, done: list[WorkerSlot], change: Change,
                  befores: dict[str, dict[str, Any]]) -> tuple[list[str], list[tuple[str, str]]]:
        restored, mixed = [], []
        for w in reversed(done):
            try:
                self._undo(w, change, befores[w.name])
                restored.append(w.name)
            except (httpx.HTTPError, ValueError) as exc:
                mixed.append((w.name, _cause(exc)))
        return restored, mixed

    @staticmethod
    def _failure(w: WorkerSlot, change: Change, cause: str, restored: list[str],
                 mixed: list[tuple[str, str]]) -> str:
        msg = f"{change.action} refused by {w.name} ({w.admin_url}): {cause}"
        if restored:
            msg += f"; undone on {', '.join(restored)}"
        if mixed:
            msg += ("; COULD NOT undo it on " + ", ".join(f"{n} ({c})" for n, c in mixed)
                    + ": the fleet is mixed, run the opposite change or restart those workers")
        else:
            msg += "; every worker serves what it served before"
        return msg

    def _persist(self, change: Change, answers: list[dict[str, Any]]) -> None:
        """Rewrite the workers' configuration: a worker restarted later starts as the others serve now."""
        data = read_worker_config(self.run.path)
        first = answers[0] if answers else {}
        # A models: list holds each model's own section (and canary); else the model: and canary: blocks.
        entries = data.get("models") or []
        name = change.model or (first.get("active") or first.get("canary") or {}).get("model")
        entry = next((e for e in entries if e.get("name") == name), entries[0] if len(entries) == 1 else None)
        model, owner = (entry, entry) if entry is not None else (data["model"], data)
        if change.action in ("reload", "promote"):
            active = first.get("active", {})
            model["path"], model["version"] = active.get("path"), active.get("version")
        if change.action == "canary":
            canary = first.get("canary", {})
            owner["canary"] = {"path": canary.get("path"), "version": canary.get("version"),
                               "weight": first.get("weight", change.weight)}
        if change.action in ("promote", "rollback"):
            owner["canary"] = {"path": None, "version": None, "weight": 0.0}
        write_worker_config(self.run.path, self.run.meta.get("env", "dev"), data)


@contextmanager
def change_lock(run_dir: Path) -> Iterator[None]:
    """One model change at a time per fleet (a second one would interleave its undo with the first)."""
    with open(run_dir / "change.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ChangeFailed("another model change is in progress on this fleet", None, [], []) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
