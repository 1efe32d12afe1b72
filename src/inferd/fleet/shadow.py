"""``inferd fleet shadow``: a shadow candidate on every worker or none, and a promotion decided on the whole
fleet's traffic.

start and stop go one worker at a time and are undone on the workers already changed when one refuses (a stop
undone starts the candidate again, with a fresh report). promote first reads every worker's drift report and
aggregates them (core/shadow.py ``aggregate``: counts summed, the worst figure of any worker), decides once,
and only then promotes each worker (forced there: the fleet has decided on more traffic than any one worker
saw); a worker that refuses has the others put back on their previous active model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from inferd.core.shadow import MIN_ITEMS, aggregate, verdict
from inferd.fleet.control import models
from inferd.fleet.layout import WorkerSlot
from inferd.fleet.rollout import Change, ChangeFailed, Rollout, _cause, _slot


@dataclass(frozen=True)
class ShadowChange:
    op: str  # start, stop, promote, report
    model: str | None = None
    path: str | None = None
    version: str | None = None
    weight: float | None = None
    force: bool = False


class ShadowRollout(Rollout):
    """The shadow actions over a fleet's workers (the admin API's /admin/models/shadow routes)."""

    def _call(self, w: WorkerSlot, method: str, route: str, model: str | None, body: dict[str, Any] | None = None,
              **params: Any) -> dict[str, Any]:
        query = {**({"model": model} if model else {}), **params}
        r = self.client.request(method, f"{w.admin_url}/admin/models/{route}", json=body, params=query or None,
                                headers={"Authorization": f"Bearer {self.key}"})
        r.raise_for_status()
        return r.json()

    def _each(self, what: str, fn: Callable[[WorkerSlot], dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``fn`` on every worker, before anything changes: any failure stops it all."""
        out = {}
        for w in self.run.layout.workers:
            try:
                out[w.name] = fn(w)
            except (httpx.HTTPError, ValueError) as exc:
                raise ChangeFailed(f"{w.name} ({w.admin_url}) did not answer {what}: {_cause(exc)}; no worker was "
                                   "changed", w.name, [], []) from None
        return out

    def reports(self, model: str | None) -> dict[str, dict[str, Any]]:
        return self._each("GET /admin/models/shadow", lambda w: self._call(w, "GET", "shadow", model))

    def decide(self, change: ShadowChange, gate: Any, min_items: int = MIN_ITEMS) -> dict[str, Any]:
        """Every worker's report aggregated, and the verdict on it."""
        states = self.reports(change.model)
        merged = aggregate([s["report"] for s in states.values()])
        decided = verdict(merged["task"], merged["items"], merged["figures"], gate, min_items)
        return {**merged, "verdict": {"promote": decided.ok, "code": decided.code, "reasons": decided.reasons,
                                      "min_items": min_items}}

    def apply_shadow(self, change: ShadowChange, gate: Any, min_items: int = MIN_ITEMS) -> list[dict[str, Any]]:
        workers = self.run.layout.workers
        if change.op == "start":
            body = {**({"model": change.model} if change.model else {}), "path": change.path,
                    "version": change.version, "weight": change.weight}
            self._each("GET /admin/models", lambda w: models(self.client, w, self.key, change.model))
            return self._in_turn(change, lambda w: self._call(w, "POST", "shadow", None, body),
                                 lambda w, _: self._call(w, "DELETE", "shadow", change.model))
        if change.op == "stop":
            states = self.reports(change.model)

            def restart(w: WorkerSlot, _: Any) -> dict[str, Any]:
                s = states[w.name]
                again = {**({"model": change.model} if change.model else {}), "path": s["shadow"]["path"],
                         "version": s["shadow"]["version"], "weight": s["weight"]}
                return self._call(w, "POST", "shadow", None, again)

            return self._in_turn(change, lambda w: self._call(w, "DELETE", "shadow", change.model), restart)
        # promote: decided once, on the whole fleet's traffic
        decision = self.decide(change, gate, min_items)
        if not decision["verdict"]["promote"]:
            reasons = "; ".join(decision["verdict"]["reasons"])
            if not change.force:
                raise ChangeFailed(f"{decision['verdict']['code']}: {reasons} (over {len(workers)} workers; --force "
                                   "overrides); no worker was changed", None, [], [])
            self.say(f"promoting against the drift report (--force): {reasons}")
        befores = self._each("GET /admin/models", lambda w: models(self.client, w, self.key, change.model))

        def back(w: WorkerSlot, _: Any) -> dict[str, Any]:
            active = _slot(befores[w.name], "active") or {}
            named = {"model": change.model} if change.model else {}
            return self._call(w, "POST", "reload", None, {**named, "path": active.get("path"),
                                                          "version": active.get("version")})

        answers = self._in_turn(change, lambda w: self._call(w, "POST", "shadow/promote", change.model, force="true"),
                                back)
        self._persist(Change("reload", model=change.model), answers)
        return answers

    def _in_turn(self, change: ShadowChange, do: Callable[[WorkerSlot], dict[str, Any]],
                 undo: Callable[[WorkerSlot, Any], dict[str, Any]]) -> list[dict[str, Any]]:
        done: list[WorkerSlot] = []
        answers = []
        for w in self.run.layout.workers:
            try:
                answers.append(do(w))
            except (httpx.HTTPError, ValueError) as exc:
                cause = _cause(exc)
                self.say(f"{w.name} refused shadow {change.op}: {cause}; undoing it on {len(done)} worker(s)")
                restored, mixed = [], []
                for d in reversed(done):
                    try:
                        undo(d, None)
                        restored.append(d.name)
                    except (httpx.HTTPError, ValueError) as undo_exc:
                        mixed.append((d.name, _cause(undo_exc)))
                raise ChangeFailed(self._failure(w, Change(f"shadow {change.op}"), cause, restored, mixed), w.name,
                                   restored, mixed) from None
            done.append(w)
            self.say(f"{w.name}: shadow {change.op} done")
        return answers
