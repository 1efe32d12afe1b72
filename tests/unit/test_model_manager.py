"""ModelManager alone, with a fake loader: slots and references, swaps, failures, the path allow-list, routing."""

from __future__ import annotations

import gc
import json
import math
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeHandler
from settingskit import make_settings

from inferd.core import loading
from inferd.core.errors import (
    ManagerClosed,
    ModelLoadError,
    ModelNotReady,
    NoCanary,
    ReloadInProgress,
    SpaceChanged,
    VersionInUse,
)
from inferd.core.loading import check_model_path
from inferd.core.manager import ModelManager
from inferd.core.spec import ModelSpec


class Loader:
    """Records every spec; raises for folders named "broken*"; can be held open by a test."""

    def __init__(self) -> None:
        self.specs: list[ModelSpec] = []
        self.handlers: list[FakeHandler] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def __call__(self, spec: ModelSpec) -> Any:
        self.specs.append(spec)
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        if spec.path.name.startswith("broken-load"):
            raise ModelLoadError(f"{spec.path} has no config.json: not a Hugging Face model folder")
        if spec.path.name.startswith("broken"):
            raise KeyError("something deep inside transformers")
        handler = FakeHandler(spec)
        self.handlers.append(handler)
        return handler


@pytest.fixture
def suite(tmp_path: Path) -> dict[str, Any]:
    """This suite's settings, ``make_settings(**suite)``: the dev layers serving m1 (v1, "tiny") under tmp_path,
    which is its model.root; a test's dotted keys after them change them."""
    return {"layered": "dev", "model": {"path": str(tmp_path / "m1"), "version": "v1", "name": "tiny",
                                        "root": [str(tmp_path)]}}


@pytest.fixture
def loader() -> Loader:
    return Loader()


@pytest.fixture
def manager(suite: dict[str, Any], loader: Loader) -> ModelManager:
    m = ModelManager(make_settings(**suite), loader)
    m.load_initial()
    return m


def use(manager: ModelManager, **kw: Any) -> str:
    slot = manager.pick(**kw)
    try:
        return slot.version
    finally:
        slot.release()


# -- reload ---------------------------------------------------------------------------------------------


def test_reload_switches_new_requests_and_frees_the_old_model_after_its_last_request(
        loader: Loader, tmp_path: Path, suite: dict[str, Any]) -> None:
    changes: list[list[tuple[str, str]]] = []  # the served slots, as the manager tells them after each change
    manager = ModelManager(make_settings(**suite), loader,
                           on_change=lambda slots: changes.append([(role, s.version) for role, s in slots]))
    manager.load_initial()
    held = manager.pick()  # a request running on v1 during the swap
    old_handler = held.handler

    manager.reload(str(tmp_path / "m2"), "v2")

    assert use(manager) == "v2" and manager.switches == 1
    assert changes == [[("active", "v1")], [("active", "v2")]]
    assert held.version == "v1" and not held.freed.is_set() and not old_handler.closed
    held.release()
    assert held.freed.is_set() and old_handler.closed
    # Describing the retired slot stays safe for a reader that snapshotted it before the swap.
    assert held.description.dimension == 32


@pytest.mark.parametrize(("folder", "cause"), [
    ("broken-load", "has no config.json"),
    ("broken-other", "KeyError"),
])
def test_a_failed_reload_leaves_the_active_model_serving(manager: ModelManager, tmp_path: Path, folder: str,
                                                         cause: str) -> None:
    with pytest.raises(ModelLoadError, match=cause):
        manager.reload(str(tmp_path / folder), "v2")
    assert use(manager) == "v1" and manager.switches == 0 and manager.state == "ready"
    # The lock is released after a failure: the next reload goes ahead.
    manager.reload(str(tmp_path / "m2"), "v2")
    assert use(manager) == "v2"


def test_a_different_dimension_is_refused_and_the_loaded_standby_released(
        tmp_path: Path, suite: dict[str, Any], loader: Loader) -> None:
    manager = ModelManager(make_settings(**suite), loader)
    manager.load_initial()
    with pytest.raises(ModelLoadError, match="dimension is 48.*serving model's is 32.*allow_dimension_change"):
        manager.reload(str(tmp_path / "dim48-x"), "v2")
    assert use(manager) == "v1"

    allowing = ModelManager(make_settings(**suite, **{"model.allow_dimension_change": True}), loader)
    allowing.load_initial()
    allowing.reload(str(tmp_path / "dim48-x"), "v2")
    assert allowing.active is not None and allowing.active.description.dimension == 48


def test_a_change_while_another_is_loading_is_refused(manager: ModelManager, loader: Loader,
                                                      tmp_path: Path) -> None:
    loader.gate, loader.entered = threading.Event(), threading.Event()
    first = threading.Thread(target=manager.reload, args=(str(tmp_path / "m2"), "v2"))
    first.start()
    assert loader.entered.wait(10)
    try:
        for change in (lambda: manager.reload(str(tmp_path / "m3"), "v3"),
                       lambda: manager.set_canary(str(tmp_path / "m3"), "v3", 0.5),
                       manager.promote, manager.rollback):
            with pytest.raises(ReloadInProgress):
                change()
        assert use(manager) == "v1"  # still serving the old model while the new one loads
    finally:
        loader.gate.set()
        first.join(10)
    assert use(manager) == "v2" and manager.switches == 1


def test_reload_before_any_model_is_loaded_is_not_ready(tmp_path: Path, suite: dict[str, Any], loader: Loader) -> None:
    manager = ModelManager(make_settings(**suite), loader)
    with pytest.raises(ModelNotReady):
        manager.reload(str(tmp_path / "m2"), "v2")


def test_a_reload_recovers_a_failed_start(tmp_path: Path, suite: dict[str, Any], loader: Loader) -> None:
    manager = ModelManager(make_settings(**suite, **{"model.path": str(tmp_path / "broken-load")}), loader)
    with pytest.raises(ModelLoadError):
        manager.load_initial()
    assert manager.state == "failed"
    manager.reload(str(tmp_path / "m2"), "v2")
    assert manager.state == "ready" and use(manager) == "v2"


def test_reload_from_settings_applies_the_new_model_section(manager: ModelManager, tmp_path: Path,
                                                            suite: dict[str, Any], loader: Loader) -> None:
    elsewhere = tmp_path.parent / "elsewhere" / "m9"  # outside model.root: the operator's own config
    fresh = make_settings(**suite, **{"model.path": str(elsewhere), "model.version": "v9",
                                      "model.pooling": "cls"})
    slot = manager.reload_from_settings(fresh)
    assert slot.version == "v9" and use(manager) == "v9"
    assert loader.specs[-1].path == elsewhere and loader.specs[-1].pooling == "cls"


def test_a_reload_that_turns_backend_auto_on_starts_its_judging_and_one_that_turns_it_off_ends_it(
        manager: ModelManager, suite: dict[str, Any], loader: Loader) -> None:
    """A SIGHUP from backend torch to auto served on torch for ever: the judge was made at start or never."""
    assert manager.auto is None
    wanted = ["openvino-float32"]
    manager.reload_from_settings(make_settings(**suite, **{"model.version": "v2", "model.backend": "auto",
                                                           "model.auto_candidates": wanted}))
    auto = manager.auto
    assert auto is not None and auto.wanted == tuple(wanted) and auto.started_at is not None
    auto.wait(30)
    judged = {v.candidate: v.state for v in auto.verdicts if v.state != "skipped"}
    assert list(judged) == wanted and judged[wanted[0]] != "pending", auto.verdicts
    # Other candidates: a judge of its own for them; back to torch: none, the old one stopped.
    manager.reload_from_settings(make_settings(**suite, **{"model.version": "v3", "model.backend": "auto"}))
    assert manager.auto is not None and manager.auto is not auto and manager.auto.wanted == ()
    previous = manager.auto
    manager.reload_from_settings(make_settings(**suite, **{"model.version": "v4", "model.backend": "torch"}))
    assert manager.auto is None and previous.state in ("done", "stopped")
    assert loader.specs[-1].backend == "torch"


def test_twenty_reloads_free_every_retired_model(manager: ModelManager, tmp_path: Path) -> None:
    retired = []
    for i in range(20):
        retired.append(manager.active)
        manager.reload(str(tmp_path / f"m{i % 2}"), f"r{i}")
    assert all(s is not None and s.freed.is_set() and s.handler.closed for s in retired)
    assert manager.switches == 20 and manager.active is not None and manager.active.refs == 0


# -- the heap after a load -------------------------------------------------------------------------------


class _Node:
    """A cyclic garbage a load leaves behind (weak-referenceable, so the test can see it go)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def quiet_collector() -> Any:
    """The automatic collector off and nothing frozen, for the test; both restored after it."""
    enabled = gc.isenabled()
    gc.disable()
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


@pytest.mark.parametrize("freeze", [True, False])
def test_a_load_collects_its_garbage_and_freezes_the_loaded_heap_when_asked(
        freeze: bool, suite: dict[str, Any], quiet_collector: None) -> None:
    left: list[weakref.ref] = []

    def loader(spec: ModelSpec) -> FakeHandler:
        left.append(weakref.ref(_Node()))  # unreachable at once; only a collection frees a cycle
        return FakeHandler(spec)

    before = [object(), [1]]  # a long-lived container, alive before the load
    manager = ModelManager(make_settings(**suite, **{"memory.freeze_heap": freeze}), loader)
    manager.load_initial()
    assert manager.state == "ready"
    if freeze:
        assert left[0]() is None  # collected before freezing: garbage is not kept for ever
        assert gc.get_freeze_count() > 0
        assert not any(o is before for g in range(3) for o in gc.get_objects(g))  # out of the collector's walks
    else:
        assert left[0]() is not None and gc.get_freeze_count() == 0


# -- versions: one label, one model ---------------------------------------------------------------------


def test_a_reload_under_a_served_version_is_refused_before_loading(with_canary: ModelManager, tmp_path: Path,
                                                                   suite: dict[str, Any], loader: Loader) -> None:
    before = len(loader.specs)
    for version, role in (("v1", "active"), ("v2", "canary")):
        with pytest.raises(VersionInUse, match=f"'{version}' is already being served by the {role} model") as info:
            with_canary.reload(str(tmp_path / "other"), version)
        assert (info.value.version, info.value.role) == (version, role)
        with pytest.raises(VersionInUse):
            with_canary.set_canary(str(tmp_path / "other"), version, 0.5)
    # SIGHUP: a new model.path under the same model.version.
    with pytest.raises(VersionInUse, match="'v1'"):
        with_canary.reload_from_settings(make_settings(**suite, **{"model.path": str(tmp_path / "other")}))
    assert len(loader.specs) == before and with_canary.switches == 0
    assert [(r, s.version, s.spec.path.name) for r, s in with_canary.slots()] == [("active", "v1", "m1"),
                                                                                  ("canary", "v2", "m2")]
    with_canary.reload(str(tmp_path / "other"), "v3")  # the lock was released: a new version goes ahead
    assert use(with_canary, model="v3") == "v3"


def test_every_load_has_its_own_identity_and_freeing_says_whether_its_version_is_gone(
        loader: Loader, tmp_path: Path, suite: dict[str, Any]) -> None:
    freed: list[tuple[str, int, bool]] = []
    manager = ModelManager(make_settings(**suite), loader,
                           on_freed=lambda slot, last: freed.append((slot.version, slot.load_id, last)))
    manager.load_initial()
    first = manager.pick()  # a request still on the first v1 when v1 is loaded again
    manager.reload(str(tmp_path / "m2"), "v2")
    manager.reload(str(tmp_path / "m3"), "v1")  # v1 is not served any more: the label may be reused
    again = manager.active
    assert again is not None and again.load_id != first.load_id and again.version == first.version == "v1"
    first.release()
    manager.reload(str(tmp_path / "m4"), "v4")
    assert [(v, last) for v, _, last in freed] == [("v2", True), ("v1", False), ("v1", True)]
    assert freed[1][1] == first.load_id and freed[2][1] == again.load_id


def test_frees_run_on_the_thread_they_are_posted_to(loader: Loader, tmp_path: Path, suite: dict[str, Any]) -> None:
    posted: list[Any] = []
    manager = ModelManager(make_settings(**suite), loader, post_to_worker=posted.append)  # the engine's: its worker
    manager.load_initial()
    old = manager.active
    assert old is not None
    manager.reload(str(tmp_path / "m2"), "v2")
    assert not old.freed.is_set() and not old.usable and len(posted) == 1
    posted.pop()()
    assert old.freed.is_set() and old.handler.closed


# -- shutdown: close wins -------------------------------------------------------------------------------


def test_a_reload_that_finishes_after_close_is_discarded(manager: ModelManager, loader: Loader,
                                                         tmp_path: Path) -> None:
    loader.gate, loader.entered = threading.Event(), threading.Event()
    outcome: list[BaseException] = []

    def reload() -> None:
        try:
            manager.reload(str(tmp_path / "m2"), "v2")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=reload)
    thread.start()
    assert loader.entered.wait(10)
    old = manager.active
    manager.close()
    loader.gate.set()
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], ManagerClosed)
    assert manager.active is None and manager.slots() == [] and manager.switches == 0
    with pytest.raises(ModelNotReady):
        manager.pick()
    new_handler = loader.handlers[-1]
    assert old is not None and old.freed.is_set() and new_handler.closed  # nothing left loaded
    with pytest.raises(ManagerClosed):
        manager.reload(str(tmp_path / "m3"), "v3")


def test_a_first_load_that_finishes_after_close_is_discarded(suite: dict[str, Any], loader: Loader) -> None:
    manager = ModelManager(make_settings(**suite), loader)
    loader.gate, loader.entered = threading.Event(), threading.Event()
    thread = threading.Thread(target=manager.load_initial)
    thread.start()
    assert loader.entered.wait(10)
    manager.close()
    loader.gate.set()
    thread.join(10)
    assert manager.active is None and manager.state == "closed" and loader.handlers[-1].closed


# -- the path allow-list ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "cause"), [
    ("https://example.com/model", "only local folders"),
    ("s3://bucket/model", "only local folders"),
    ("file:///etc", "only local folders"),
    ("hf://org/model", "only local folders"),
    ("{root}/../etc", "'..' is not allowed"),
    ("{root}/a/../../x", "'..' is not allowed"),
    ("/etc", "not under an allowed model.root"),
    ("", "non-empty"),
    ("{root}/m\x00x", "control characters"),  # os calls would raise ValueError: a 500
    ("{root}/m\nx", "control characters"),
])
def test_paths_outside_the_allow_list_are_refused(tmp_path: Path, raw: str, cause: str) -> None:
    with pytest.raises(ModelLoadError, match=cause):
        check_model_path(raw.format(root=tmp_path), [tmp_path.resolve()])


def test_a_symlink_out_of_the_root_is_refused_and_folders_inside_are_accepted(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "m").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    assert check_model_path(str(root / "m"), [root.resolve()]) == (root / "m").resolve()
    with pytest.raises(ModelLoadError, match="not under an allowed model.root"):
        check_model_path(str(root / "escape"), [root.resolve()])


def test_reload_applies_the_allow_list_before_loading(manager: ModelManager, loader: Loader) -> None:
    before = len(loader.specs)
    with pytest.raises(ModelLoadError, match="not under an allowed model.root"):
        manager.reload("/etc", "v2")
    assert len(loader.specs) == before


def test_the_default_root_is_the_initial_models_parent(tmp_path: Path, loader: Loader) -> None:
    settings = make_settings(tmp_path / "models" / "m1", layered="dev")
    assert ModelManager(settings, loader).roots == [(tmp_path / "models").resolve()]


# -- canary routing --------------------------------------------------------------------------------------


def within_binomial(hits: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(hits - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


@pytest.fixture
def with_canary(manager: ModelManager, tmp_path: Path) -> ModelManager:
    manager.set_canary(str(tmp_path / "m2"), "v2", 0.2)
    return manager


def test_random_routing_follows_the_weight(with_canary: ModelManager) -> None:
    counts = Counter(use(with_canary) for _ in range(1000))
    assert set(counts) == {"v1", "v2"}
    # 5 sigma of Binomial(1000, 0.2): 200 ± 63; a wrong weight (0.5, or 0) lands far outside.
    assert within_binomial(counts["v2"], 1000, 0.2), counts


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_weights_zero_and_one_are_absolute(manager: ModelManager, tmp_path: Path, weight: float) -> None:
    manager.set_canary(str(tmp_path / "m2"), "v2", weight)
    expected = "v2" if weight == 1.0 else "v1"
    assert {use(manager) for _ in range(300)} == {expected}
    assert {use(manager, routing_key=f"user-{i}") for i in range(300)} == {expected}


def test_routing_keys_are_sticky_and_spread_by_the_weight(with_canary: ModelManager) -> None:
    first = {f"user-{i}": use(with_canary, routing_key=f"user-{i}") for i in range(1000)}
    for _ in range(3):
        assert {k: use(with_canary, routing_key=k) for k in first} == first
    assert within_binomial(sum(v == "v2" for v in first.values()), 1000, 0.2)


def test_a_new_manager_routes_each_key_as_the_old_one_did(tmp_path: Path, suite: dict[str, Any],
                                                          loader: Loader) -> None:
    # Sticky across restarts and replicas: the bucket is a hash of the key, not process state.
    seen = []
    for _ in range(2):
        m = ModelManager(make_settings(**suite), loader)
        m.load_initial()
        m.set_canary(str(tmp_path / "m2"), "v2", 0.5)
        seen.append([use(m, routing_key=f"k{i}") for i in range(200)])
    assert seen[0] == seen[1] and set(seen[0]) == {"v1", "v2"}


@pytest.mark.parametrize(("model", "version"), [
    ("v2", "v2"), ("tiny@v2", "v2"), ("v1", "v1"), ("tiny@v1", "v1")])
def test_the_model_field_pins_a_version_over_weight_and_key(with_canary: ModelManager, model: str,
                                                            version: str) -> None:
    assert {use(with_canary, model=model, routing_key=f"k{i}") for i in range(200)} == {version}
    assert {use(with_canary, model=model) for _ in range(200)} == {version}


def test_an_unknown_model_name_is_routed_as_usual(with_canary: ModelManager) -> None:
    counts = Counter(use(with_canary, model="text-embedding-3-small") for _ in range(1000))
    assert within_binomial(counts["v2"], 1000, 0.2), counts


def test_promote_makes_the_canary_active_and_frees_the_old_active(with_canary: ModelManager) -> None:
    old = with_canary.active
    assert old is not None
    switches = with_canary.switches
    with_canary.promote()
    assert with_canary.canary is None and with_canary.canary_weight == 0.0
    assert {use(with_canary) for _ in range(100)} == {"v2"}
    assert with_canary.switches == switches + 1 and old.freed.is_set()
    with pytest.raises(NoCanary):
        with_canary.promote()


def test_rollback_drops_the_canary_and_keeps_the_active(with_canary: ModelManager) -> None:
    canary = with_canary.canary
    assert canary is not None
    held = with_canary.pick(model="v2")  # a request on the canary when it is rolled back
    with_canary.rollback()
    assert {use(with_canary, routing_key=f"k{i}") for i in range(200)} == {"v1"}
    assert use(with_canary, model="v2") == "v1"  # pinning a version no longer served falls back
    assert not canary.freed.is_set()
    held.release()
    assert canary.freed.is_set()
    with pytest.raises(NoCanary):
        with_canary.rollback()


def test_a_canary_needs_its_own_version_and_a_valid_weight(manager: ModelManager, tmp_path: Path) -> None:
    with pytest.raises(VersionInUse, match="'v1' is already being served by the active model"):
        manager.set_canary(str(tmp_path / "m2"), "v1", 0.2)
    with pytest.raises(ValueError, match="weight"):
        manager.set_canary(str(tmp_path / "m2"), "v2", 1.5)
    assert manager.canary is None


def test_a_configured_canary_is_loaded_with_the_model(tmp_path: Path, suite: dict[str, Any], loader: Loader) -> None:
    settings = make_settings(**suite, **{"canary.path": str(tmp_path / "m2"), "canary.version": "v2",
                                         "canary.weight": 0.3})
    manager = ModelManager(settings, loader)
    manager.load_initial()
    assert [(role, s.version) for role, s in manager.slots()] == [("active", "v1"), ("canary", "v2")]
    assert manager.canary_weight == 0.3


def test_a_configured_canary_of_another_dimension_fails_the_start_unless_forced(
        tmp_path: Path, suite: dict[str, Any], loader: Loader) -> None:
    canary = {"canary.path": str(tmp_path / "dim48-c"), "canary.version": "v2", "canary.weight": 0.3}
    manager = ModelManager(make_settings(**suite, **canary), loader)
    with pytest.raises(ModelLoadError, match="canary.path"):
        manager.load_initial()
    assert manager.state == "failed" and "48 dimensions, the active model's 32" in (manager.reason or "")
    assert "canary.force: true" in (manager.reason or "")
    # Another size is another space, which canary.force overrides (docs/changing-a-model.md).
    forced = ModelManager(make_settings(**suite, **canary, **{"canary.force": True}), loader)
    forced.load_initial()
    assert [(role, s.version) for role, s in forced.slots()] == [("active", "v1"), ("canary", "v2")]


def test_a_canary_of_another_dimension_is_another_space_which_force_overrides(manager: ModelManager, loader: Loader,
                                                                             tmp_path: Path) -> None:
    # The probe's: 422 model_load_failed ("set model.allow_dimension_change"), which no force could lift.
    with pytest.raises(SpaceChanged, match="48 dimensions, the active model's 32.*force"):
        manager.set_canary(str(tmp_path / "dim48-c"), "c2", 0.5)
    assert manager.canary is None and loader.handlers[-1].closed
    forced = manager.set_canary(str(tmp_path / "dim48-c"), "c3", 0.5, force=True)
    assert manager.canary is forced and forced.description.dimension == 48
    # A reload keeps its own rule: another size needs model.allow_dimension_change.
    with pytest.raises(ModelLoadError, match="allow_dimension_change"):
        manager.reload(str(tmp_path / "dim48-r"), "v2")


# -- SIGHUP: the canary and the rules of change as the settings say ----------------------------------------------


def test_the_canary_section_of_reread_settings_is_installed_reweighted_replaced_and_dropped(
        manager: ModelManager, loader: Loader, tmp_path: Path, suite: dict[str, Any]) -> None:
    def canary(**section: Any) -> Any:
        return make_settings(**suite, canary={"weight": 0.5, **section})

    first = manager.canary_from_settings(canary(path=str(tmp_path / "c1"), version="cv"))
    assert first is not None and manager.canary is first and manager.canary_weight == 0.5
    loads = len(loader.specs)
    # The canary it already serves: a new weight, nothing loaded.
    assert manager.canary_from_settings(canary(path=str(tmp_path / "c1"), version="cv", weight=0.2)) is first
    assert manager.canary_weight == 0.2 and len(loader.specs) == loads and not first.freed.is_set()
    second = manager.canary_from_settings(canary(path=str(tmp_path / "c2"), version="cv2"))
    assert manager.canary is second and first.freed.is_set()
    # Another space (another size) is refused as at start, unless canary.force.
    with pytest.raises(SpaceChanged, match="canary.path .*dim48-c: .*48 dimensions"):
        manager.canary_from_settings(canary(path=str(tmp_path / "dim48-c"), version="cv3"))
    assert manager.canary is second
    assert manager.canary_from_settings(make_settings(**suite)) is None
    assert manager.canary is None and second.freed.is_set()
    assert [(r, s.version) for r, s in manager.slots()] == [("active", "v1")]


def test_followed_settings_rule_the_later_changes(manager: ModelManager, loader: Loader, tmp_path: Path,
                                                 suite: dict[str, Any]) -> None:
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    with pytest.raises(ModelLoadError, match="not under an allowed model.root"):
        manager.reload(str(elsewhere / "m2"), "v2")
    manager.follow(make_settings(**suite, **{"model.root": [str(elsewhere)], "model.allow_dimension_change": True,
                                             "model.load_timeout_s": 7.0}))
    assert manager.roots == [elsewhere.resolve()] and manager.rollout.change_lock.timeout_s == 7.0
    slot = manager.reload(str(elsewhere / "dim48-m"), "v2")  # the new root, and the consent to another size
    assert manager.active is slot and slot.description.dimension == 48
    with pytest.raises(ModelLoadError, match="not under an allowed model.root"):
        manager.reload(str(tmp_path / "m3"), "v3")


def test_a_model_over_its_memory_fraction_is_refused_and_closed(suite: dict[str, Any], loader: Loader,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Several models on one GPU: a load taking more of the device than model.memory_fraction is refused (the
    device's figures injected: this machine has no GPU)."""
    import inferd.core.slot_loader as loader_module

    gib = 2**30
    readings = iter([(1 * gib, 10 * gib), (5 * gib, 10 * gib), (1 * gib, 10 * gib), (3 * gib, 10 * gib)])
    monkeypatch.setattr(loader_module, "device_memory", lambda device: next(readings))
    tight = ModelManager(make_settings(**suite, **{"model.memory_fraction": 0.3}), loader)
    with pytest.raises(ModelLoadError, match=r"took 4.00 GiB .* more than its model.memory_fraction 0.3"):
        tight.load_initial()
    assert loader.handlers[-1].closed and tight.state == "failed"
    roomy = ModelManager(make_settings(**suite, **{"model.memory_fraction": 0.3}), loader)
    roomy.load_initial()  # 2 GiB of 10: within 0.3
    assert roomy.state == "ready" and not loader.handlers[-1].closed
    monkeypatch.setattr(loader_module, "device_memory", lambda device: None)  # a CPU: nothing to check
    ModelManager(make_settings(**suite, **{"model.memory_fraction": 0.01}), loader).load_initial()


def test_the_models_memory_fractions_must_fit_the_process(tmp_path: Path) -> None:
    from inferd.config import ConfigError

    models = [{"name": "a", "path": str(tmp_path), "memory_fraction": 0.5},
              {"name": "b", "path": str(tmp_path), "memory_fraction": 0.4}]
    assert len(make_settings(layered="dev", models=models).served()) == 2
    with pytest.raises(ConfigError, match="add up to 0.9, more than the process may use"):
        make_settings(layered="dev", models=models, **{"memory.per_process_fraction": 0.8})


def test_an_auto_task_not_loaded_yet_is_read_from_its_folder_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 loader: Loader) -> None:
    """Issue 40: routing asks a lazy model's task before its load, for every request, on the event loop; with
    ``task: auto`` each ask re-read config.json and modules.json. Read once, then kept."""
    folder = tmp_path / "cross-encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"],
                                                    "id2label": {"0": "LABEL_0"}}))
    reads: list[Path] = []
    detect = loading.detect_task
    monkeypatch.setattr(loading, "detect_task", lambda path: reads.append(path) or detect(path))
    manager = ModelManager(make_settings(folder, model={"task": "auto", "load_mode": "lazy"}), loader)
    assert [manager.task for _ in range(3)] == ["rerank"] * 3
    assert reads == [folder]
