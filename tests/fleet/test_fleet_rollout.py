"""All-or-nothing model changes, unit-tested against fake workers (httpx.MockTransport speaking the admin API).

The real thing (real workers refusing a real reload) is in test_fleet_service.py; here every action and every
way an undo can go is driven exactly: which worker refuses, and whether the undo itself fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from inferd.fleet.control import RunDir
from inferd.fleet.layout import Layout, WorkerSlot
from inferd.fleet.rollout import Change, ChangeFailed, Rollout, change_lock
from inferd.fleet.worker_config import read_worker_config, write_worker_config

KEY = "admin-key"


class FakeWorker:
    """One worker's model slots behind its admin API; ``refuse`` maps a route to the status it answers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.active = {"path": "/models/v1", "version": "v1"}
        self.canary: dict[str, Any] | None = None
        self.weight = 0.0
        self.refuse: dict[str, int] = {}
        self.posts: list[tuple[str, dict[str, Any] | None]] = []
        self.down = False

    def models(self) -> dict[str, Any]:
        slots = [{"role": "active", **self.active}] + ([{"role": "canary", **self.canary}] if self.canary else [])
        return {"state": "ready", "switches": 0, "canary_weight": self.weight, "slots": slots}

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        assert request.headers["authorization"] == f"Bearer {KEY}"
        route = request.url.path.removeprefix("/admin/models").strip("/") or "models"
        if request.method == "GET":
            return httpx.Response(200, json=self.models())
        body = json.loads(request.content) if request.content else None
        self.posts.append((route, body))
        if route in self.refuse:
            err = {"message": f"{self.name} says no", "type": "invalid_request_error", "code": "model_load_failed",
                   "param": "path"}
            return httpx.Response(self.refuse[route], json={"error": err})
        if route == "reload":
            self.active = {"path": body["path"], "version": body["version"]}
            return httpx.Response(200, json={"status": "switched", "active": self.active})
        if route == "canary":
            self.canary, self.weight = {"path": body["path"], "version": body["version"]}, body["weight"]
            return httpx.Response(200, json={"status": "canary", "canary": self.canary, "weight": self.weight})
        if self.canary is None:
            return httpx.Response(409, json={"error": {"message": "there is no canary", "type": "conflict_error",
                                                       "code": "no_canary", "param": None}})
        if route == "promote":
            self.active, self.canary, self.weight = self.canary, None, 0.0
            return httpx.Response(200, json={"status": "promoted", "active": self.active})
        self.canary, self.weight = None, 0.0  # rollback
        return httpx.Response(200, json={"status": "rolled_back", "active": self.active})

    def state(self) -> tuple[Any, ...]:
        return (self.active["version"], self.canary and self.canary["version"], self.weight)


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[RunDir, list[FakeWorker], httpx.Client]:
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
    return RunDir(tmp_path), fakes, client


def test_a_reload_reaches_every_worker_and_the_configuration(fleet: tuple[RunDir, list[FakeWorker], httpx.Client]
                                                             ) -> None:
    run, fakes, client = fleet
    answers = Rollout(run, client).apply(Change("reload", "/models/v2", "v2"))
    assert [a["active"]["version"] for a in answers] == ["v2"] * 3
    assert {f.state() for f in fakes} == {("v2", None, 0.0)}
    model = read_worker_config(run.path)["model"]
    assert (model["path"], model["version"]) == ("/models/v2", "v2")
    # The configuration keeps its header: an operator reading it learns who writes it.
    assert (run.path / "config" / "base.yaml").read_text().startswith("# The workers' configuration")


@pytest.mark.parametrize("refuser", [0, 1, 2])
def test_a_reload_one_worker_refuses_is_undone_on_the_others(fleet: tuple[RunDir, list[FakeWorker], httpx.Client],
                                                             refuser: int) -> None:
    run, fakes, client = fleet
    fakes[refuser].refuse["reload"] = 422
    config = (run.path / "config" / "base.yaml").read_text()
    with pytest.raises(ChangeFailed) as info:
        Rollout(run, client).apply(Change("reload", "/models/v2", "v2"))
    err = info.value
    assert err.worker == f"worker-{refuser}" and err.mixed == []
    assert err.restored == [f"worker-{i}" for i in reversed(range(refuser))]  # newest first
    assert f"refused by worker-{refuser}" in str(err) and "422 model_load_failed" in str(err)
    assert f"worker-{refuser} says no" in str(err)
    assert {f.state() for f in fakes} == {("v1", None, 0.0)}
    for f in fakes[:refuser]:  # switched, then switched back to exactly what it served
        assert f.posts == [("reload", {"path": "/models/v2", "version": "v2"}),
                           ("reload", {"path": "/models/v1", "version": "v1"})]
    assert all(f.posts == [] for f in fakes[refuser + 1:])
    assert (run.path / "config" / "base.yaml").read_text() == config


def test_an_unreachable_worker_stops_the_change_before_any_worker_changes(
        fleet: tuple[RunDir, list[FakeWorker], httpx.Client]) -> None:
    run, fakes, client = fleet
    fakes[2].down = True
    with pytest.raises(ChangeFailed, match="worker-2 .* no worker was changed"):
        Rollout(run, client).apply(Change("reload", "/models/v2", "v2"))
    assert all(f.posts == [] for f in fakes)


def test_canary_promote_and_rollback_are_undone_to_the_previous_canary(
        fleet: tuple[RunDir, list[FakeWorker], httpx.Client]) -> None:
    run, fakes, client = fleet
    rollout = Rollout(run, client)
    rollout.apply(Change("canary", "/models/c1", "c1", 0.1))
    assert {f.state() for f in fakes} == {("v1", "c1", 0.1)}
    assert read_worker_config(run.path)["canary"] == {"path": "/models/c1", "version": "c1", "weight": 0.1}
    fakes[1].refuse["canary"] = 409
    with pytest.raises(ChangeFailed):
        rollout.apply(Change("canary", "/models/c2", "c2", 0.5))
    assert {f.state() for f in fakes} == {("v1", "c1", 0.1)}  # worker-0 has its old canary back
    fakes[1].refuse = {"promote": 503}
    with pytest.raises(ChangeFailed):
        rollout.apply(Change("promote"))
    assert {f.state() for f in fakes} == {("v1", "c1", 0.1)}  # worker-0: old active and old canary again
    fakes[1].refuse = {"rollback": 500}
    with pytest.raises(ChangeFailed):
        rollout.apply(Change("rollback"))
    assert {f.state() for f in fakes} == {("v1", "c1", 0.1)}
    fakes[1].refuse = {}
    rollout.apply(Change("promote"))
    assert {f.state() for f in fakes} == {("c1", None, 0.0)}
    data = read_worker_config(run.path)
    assert (data["model"]["version"], data["canary"]["path"]) == ("c1", None)


def test_an_undo_that_fails_says_the_fleet_is_mixed(fleet: tuple[RunDir, list[FakeWorker], httpx.Client]) -> None:
    run, fakes, client = fleet
    fakes[1].refuse["reload"] = 422
    original = fakes[0].handle

    def refuse_the_way_back(request: httpx.Request) -> httpx.Response:
        if fakes[0].posts and request.method == "POST":
            raise httpx.ReadTimeout("no answer", request=request)
        return original(request)

    fakes[0].handle = refuse_the_way_back  # type: ignore[method-assign]
    with pytest.raises(ChangeFailed) as info:
        Rollout(run, client).apply(Change("reload", "/models/v2", "v2"))
    assert info.value.mixed == [("worker-0", "ReadTimeout: no answer")]
    assert "COULD NOT undo it on worker-0" in str(info.value) and "mixed" in str(info.value)


def test_one_change_at_a_time(tmp_path: Path) -> None:
    with change_lock(tmp_path), pytest.raises(ChangeFailed, match="in progress"), change_lock(tmp_path):
        pass
    with change_lock(tmp_path):  # released: the next change may run
        pass


def test_the_configuration_stays_loadable_yaml(fleet: tuple[RunDir, list[FakeWorker], httpx.Client]) -> None:
    run, _, client = fleet
    Rollout(run, client).apply(Change("canary", "/models/c1", "c1", 0.25))
    data = yaml.safe_load((run.path / "config" / "base.yaml").read_text())
    assert data["canary"]["weight"] == 0.25 and (run.path / "config" / "dev.yaml").is_file()
