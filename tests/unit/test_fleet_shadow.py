"""``inferd fleet shadow`` against fake workers (httpx.MockTransport speaking the admin API): start and stop on
every worker or none, and promotion decided on the aggregated reports (counts summed, the worst figure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.fleet.control import RunDir
from inferd.fleet.layout import Layout, WorkerSlot
from inferd.fleet.rollout import ChangeFailed
from inferd.fleet.shadow import ShadowChange, ShadowRollout
from inferd.fleet.worker_config import read_worker_config, write_worker_config
from inferd.settings import GateSettings

KEY = "admin-key"
GATE = GateSettings()


def report(items: int, cosine_min: float) -> dict[str, Any]:
    return {"task": "embedding", "items": items,
            "requests": {"sampled": items // 4, "computed": items // 4, "shed": 0, "failed": 0},
            "figures": {"cosine_mean": 0.9999, "cosine_min": cosine_min, "cosine_p1": 0.999, "overlap_mean": 0.99}}


class FakeWorker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.active = {"path": "/models/v1", "version": "v1"}
        self.shadow: dict[str, Any] | None = None
        self.report = report(0, 1.0)
        self.refuse: set[str] = set()
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {KEY}"
        route = request.url.path.removeprefix("/admin/models").strip("/") or "models"
        params = dict(request.url.params)
        self.calls.append((request.method, route, params))
        if (request.method, route) in self.refuse:
            return httpx.Response(409, json={"error": {"message": f"{self.name} says no", "type": "conflict_error",
                                                       "code": "no", "param": None}})
        body = json.loads(request.content) if request.content else None
        if route == "models":
            return httpx.Response(200, json={"state": "ready", "slots": [{"role": "active", **self.active}]})
        if route == "reload":
            self.active = {"path": body["path"], "version": body["version"]}
            return httpx.Response(200, json={"status": "switched", "active": self.active})
        if route == "shadow" and request.method == "POST":
            self.shadow = {"path": body["path"], "version": body["version"], "weight": body["weight"]}
            return httpx.Response(200, json={"status": "shadow", "shadow": self.shadow})
        if self.shadow is None:
            return httpx.Response(404, json={"error": {"message": "none", "type": "not_found_error",
                                                       "code": "no_shadow", "param": "model"}})
        if route == "shadow" and request.method == "GET":
            return httpx.Response(200, json={"shadow": self.shadow, "weight": self.shadow["weight"],
                                             "report": self.report})
        if route == "shadow":  # DELETE
            self.shadow = None
            return httpx.Response(200, json={"status": "dropped"})
        self.active, self.shadow = {"path": self.shadow["path"], "version": self.shadow["version"]}, None
        return httpx.Response(200, json={"status": "promoted", "active": self.active})


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[ShadowRollout, list[FakeWorker], RunDir]:
    workers = [WorkerSlot(i, f"worker-{i}", 9000 + 2 * i, 9001 + 2 * i, None, 1, None) for i in range(3)]
    layout = Layout(tuple(workers), (), 2)
    (tmp_path / "layout.json").write_text(json.dumps({**layout.to_dict(), "env": "dev", "status_port": 1,
                                                      "listen": {"host": "127.0.0.1", "port": 8080}}))
    (tmp_path / "admin.key").write_text(KEY + "\n")
    write_worker_config(tmp_path, "dev", {"model": {"path": "/models/v1", "version": "v1"},
                                          "canary": {"path": None, "version": None, "weight": 0.0}})
    fakes = [FakeWorker(w.name) for w in workers]
    by_port = {w.admin_port: f for w, f in zip(workers, fakes, strict=True)}
    client = httpx.Client(transport=httpx.MockTransport(lambda r: by_port[r.url.port].handle(r)))
    run = RunDir(tmp_path)
    return ShadowRollout(run, client), fakes, run


START = ShadowChange("start", path="/models/v2", version="v2", weight=0.1)


def test_start_reaches_every_worker_or_is_undone(fleet: tuple[ShadowRollout, list[FakeWorker], RunDir]) -> None:
    rollout, fakes, _ = fleet
    fakes[2].refuse.add(("POST", "shadow"))
    with pytest.raises(ChangeFailed, match="worker-2"):
        rollout.apply_shadow(START, GATE)
    assert [f.shadow for f in fakes] == [None, None, None]
    fakes[2].refuse.clear()
    rollout.apply_shadow(START, GATE)
    assert {f.shadow["version"] for f in fakes if f.shadow} == {"v2"} and all(f.shadow for f in fakes)
    fakes[1].refuse.add(("DELETE", "shadow"))
    with pytest.raises(ChangeFailed):
        rollout.apply_shadow(ShadowChange("stop"), GATE)
    assert all(f.shadow and f.shadow["weight"] == 0.1 for f in fakes)  # worker-0's stop was undone


def test_promotion_is_decided_on_the_aggregated_reports(fleet: tuple[ShadowRollout, list[FakeWorker], RunDir]) -> None:
    rollout, fakes, run = fleet
    rollout.apply_shadow(START, GATE)
    for f in fakes:
        f.report = report(40, 0.999)  # 40 each: only the sum reaches the minimum of 100
    decided = rollout.decide(ShadowChange("report"), GATE)
    assert decided["items"] == 120 and decided["verdict"]["promote"]
    fakes[1].report = report(40, 0.5)  # one worker's drift is not averaged away
    with pytest.raises(ChangeFailed, match="shadow_drifted: cosine_min 0.500000 < 0.99"):
        rollout.apply_shadow(ShadowChange("promote"), GATE)
    assert {f.active["version"] for f in fakes} == {"v1"}
    answers = rollout.apply_shadow(ShadowChange("promote", force=True), GATE)
    assert len(answers) == 3 and {f.active["version"] for f in fakes} == {"v2"}
    assert all(("POST", "shadow/promote", {"force": "true"}) in f.calls for f in fakes)
    assert read_worker_config(run.path)["model"]["version"] == "v2"


def test_a_refused_promotion_puts_the_others_back(fleet: tuple[ShadowRollout, list[FakeWorker], RunDir]) -> None:
    rollout, fakes, _ = fleet
    rollout.apply_shadow(START, GATE)
    for f in fakes:
        f.report = report(100, 0.999)
    fakes[2].refuse.add(("POST", "shadow/promote"))
    with pytest.raises(ChangeFailed, match="undone on worker-1, worker-0"):
        rollout.apply_shadow(ShadowChange("promote"), GATE)
    assert {f.active["version"] for f in fakes} == {"v1"}
