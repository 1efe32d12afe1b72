"""The inference engine in-process, with the fake HashHandler: no HTTP, no model weights.

A batch is held by naming a gate in a text (``hold:NAME``) and opening ``handler.gates[NAME]`` later, so
each test decides exactly what is queued while the worker is busy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from enginekit import EngineKit, by_folder, hold, per_load, until
from fakes import HashHandler, ShortHandler, loader_for, vector_for
from settingskit import make_settings
from starlette.testclient import TestClient

from inferd.api.app import create_app
from inferd.api.services import services_of
from inferd.core.engine import InferenceEngine
from inferd.core.errors import ClientGone, EngineError, Kind
from inferd.core.scheduler import Policy
from inferd.core.spec import ModelSpec
from inferd.settings import BatchingSettings, ModelEntry, ModelSettings


def make_engine(tmp_path: Path, handler: HashHandler, **batching: Any) -> EngineKit:
    return EngineKit(make_settings(tmp_path, batching=batching), handler)


def computed(handler: HashHandler) -> set[str]:
    return {t for batch in handler.batches for t in batch}


def test_multi_text_requests_are_split_batched_with_others_and_reassembled_in_order(tmp_path: Path):
    handler = HashHandler()
    kit = make_engine(tmp_path, handler, max_batch_size=4)
    engine = kit.engine
    a = [f"a{i} " + "x" * n for i, n in enumerate([30, 2, 17, 9, 25, 4])]
    b = [f"b{i} " + "y" * n for i, n in enumerate([3, 28, 10])]

    async def scenario() -> None:
        held = await hold(engine, handler, "g")
        ta = asyncio.ensure_future(engine.process(engine.request(a)))
        tb = asyncio.ensure_future(engine.process(engine.request(b)))
        await until(lambda: len(engine.queue) == len(a) + len(b))
        handler.gates["g"].set()
        ra, rb, _ = await asyncio.gather(ta, tb, held)
        assert ra.outputs == [vector_for(t) for t in a]
        assert rb.outputs == [vector_for(t) for t in b]
        batches = handler.batches[1:]
        assert all(len(x) <= 4 for x in batches) and len(batches) >= 3
        # Items of both requests shared a batch, and length grouping reordered them inside it.
        assert any({t[0] for t in x} == {"a", "b"} for x in batches)

    kit.run(scenario)


def test_a_failing_batch_fails_only_its_own_requests_and_the_worker_survives(tmp_path: Path):
    handler = HashHandler()
    kit = make_engine(tmp_path, handler, max_batch_size=1)
    engine = kit.engine

    async def scenario() -> None:
        held = await hold(engine, handler, "g")
        tasks = [asyncio.ensure_future(engine.process(engine.request([t]))) for t in ("before", "fail:boom", "after")]
        await until(lambda: len(engine.queue) == 3)
        handler.gates["g"].set()
        before, failed, after = await asyncio.gather(*tasks, return_exceptions=True)
        await held
        assert isinstance(failed, EngineError) and failed.kind is Kind.FAILED
        assert before.outputs == [vector_for("before")] and after.outputs == [vector_for("after")]
        assert engine.alive
        assert (await engine.process(engine.request(["later"]))).outputs == [vector_for("later")]

    kit.run(scenario)


def test_a_batch_with_the_wrong_number_of_results_fails_alone(tmp_path: Path):
    handler = ShortHandler()
    kit = make_engine(tmp_path, handler, max_batch_size=4)
    engine = kit.engine

    async def scenario() -> None:
        held = await hold(engine, handler, "g")
        pair = [asyncio.ensure_future(engine.process(engine.request([t]))) for t in ("one", "two")]
        await until(lambda: len(engine.queue) == 2)
        handler.gates["g"].set()
        outcomes = await asyncio.gather(*pair, return_exceptions=True)
        assert [getattr(o, "kind", None) for o in outcomes] == [Kind.FAILED, Kind.FAILED]
        assert (await held).outputs == [vector_for("hold:g")]
        assert (await engine.process(engine.request(["alone"]))).outputs == [vector_for("alone")]

    kit.run(scenario)


def test_a_deadline_passing_while_queued_answers_504_at_once_and_never_computes(tmp_path: Path):
    handler = HashHandler()
    kit = make_engine(tmp_path, handler)
    engine = kit.engine

    async def scenario() -> None:
        held = await hold(engine, handler, "g")
        # The worker stays busy: the answer must come from the deadline, not from the worker coming back.
        with pytest.raises(EngineError) as info:
            await engine.process(engine.request(["too late"], timeout_ms=30))
        assert info.value.kind is Kind.DEADLINE  # counted as a rejection where it becomes a 504 (api/errors.py)
        assert len(engine.queue) == 0  # its item left the queue with it
        handler.gates["g"].set()
        await held
        assert (await engine.process(engine.request(["in time"], timeout_ms=5000))).outputs == [vector_for("in time")]
        assert "too late" not in computed(handler)

    kit.run(scenario)


def test_a_client_gone_while_queued_is_dropped_counted_and_never_computed(tmp_path: Path):
    handler = HashHandler()
    kit = make_engine(tmp_path, handler)
    engine = kit.engine

    async def scenario() -> None:
        held = await hold(engine, handler, "g")
        gone = asyncio.Event()
        victim = asyncio.ensure_future(engine.process(engine.request(["victim"]), disconnected=gone.wait))
        await until(lambda: len(engine.queue) == 1)
        gone.set()
        with pytest.raises(ClientGone):
            await victim
        handler.gates["g"].set()
        await held
        await until(lambda: kit.sample("inferd_requests_rejected_total", reason="disconnected") == 1)
        assert len(engine.queue) == 0 and "victim" not in computed(handler)

    kit.run(scenario)


def test_a_full_queue_refuses_with_retry_after_and_accepted_work_completes(tmp_path: Path):
    handler = HashHandler()
    kit = make_engine(tmp_path, handler, max_batch_size=2, max_queue=4)
    engine = kit.engine

    async def scenario() -> None:
        held = await hold(engine, handler, "g")
        accepted = [asyncio.ensure_future(engine.process(engine.request([f"q{i}"]))) for i in range(4)]
        await until(lambda: len(engine.queue) == 4)
        with pytest.raises(EngineError) as info:
            await engine.process(engine.request(["one too many"]))
        assert info.value.kind is Kind.OVERLOADED  # a 503 with Retry-After (api/errors.py)
        handler.gates["g"].set()
        results = await asyncio.gather(held, *accepted)
        assert [r.outputs for r in results[1:]] == [[vector_for(f"q{i}")] for i in range(4)]

    kit.run(scenario)


def test_a_request_larger_than_the_whole_queue_is_refused_as_invalid(tmp_path: Path):
    # Retry-After would promise a retry that can never succeed.
    kit = make_engine(tmp_path, HashHandler(), max_batch_size=2, max_queue=4)
    engine = kit.engine

    async def scenario() -> None:
        with pytest.raises(EngineError) as info:
            await engine.process(engine.request([f"t{i}" for i in range(5)]))
        assert (info.value.kind, info.value.code) == (Kind.INVALID_INPUT, "too_many_items")
        assert len((await engine.process(engine.request([f"t{i}" for i in range(4)]))).outputs) == 4

    kit.run(scenario)


def test_an_oversize_text_runs_alone_or_is_refused_when_configured(tmp_path: Path):
    handler = HashHandler()
    kit = make_engine(tmp_path, handler, max_batch_tokens=64)
    engine = kit.engine
    long_text = "L" * 100

    async def scenario() -> None:
        held = await hold(engine, handler, "g")
        tasks = [asyncio.ensure_future(engine.process(engine.request([t]))) for t in ("s1", long_text, "s2", "s3")]
        await until(lambda: len(engine.queue) == 4)
        handler.gates["g"].set()
        await asyncio.gather(held, *tasks)
        assert [long_text] in handler.batches
        assert ["s1", "s2", "s3"] in handler.batches  # the long one did not hold the others back

    kit.run(scenario)

    strict = make_engine(tmp_path, HashHandler(), max_batch_tokens=64, oversize="reject")

    async def refused() -> None:
        with pytest.raises(EngineError) as info:
            await strict.engine.process(strict.engine.request(["ok", long_text]))
        assert (info.value.kind, info.value.code, info.value.index) == (Kind.TOO_LONG, "too_many_tokens", 1)

    strict.run(refused)


class _FailingGuard:
    """A memory guard whose bookkeeping breaks: an error outside the handler must not kill the worker."""

    metrics = None

    def tick(self, n: int) -> None:
        raise RuntimeError("guard bookkeeping failed")

    def after_oom(self) -> None:
        pass


def test_the_worker_survives_an_error_outside_the_handler(tmp_path: Path):
    handler = HashHandler()
    kit = EngineKit(make_settings(tmp_path), handler, guard=_FailingGuard())
    engine = kit.engine

    async def scenario() -> None:
        for text in ("first", "second"):
            assert (await engine.process(engine.request([text]))).outputs == [vector_for(text)]
        assert engine.alive

    kit.run(scenario)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker dies on purpose
def test_a_dead_worker_answers_every_waiting_request_and_health_says_so(tmp_path: Path):
    handler = HashHandler()
    settings = make_settings(tmp_path, batching={"max_batch_size": 1})
    app = create_app(settings, loader=loader_for(handler))
    engine: InferenceEngine = services_of(app).engine

    async def doomed(engine: InferenceEngine) -> None:
        held = await hold(engine, handler, "g")
        dying = asyncio.ensure_future(engine.process(engine.request(["die:now"])))
        behind = asyncio.ensure_future(engine.process(engine.request(["behind"])))
        await until(lambda: len(engine.queue) == 2)
        handler.gates["g"].set()
        assert (await held).outputs == [vector_for("hold:g")]
        # Neither the request in the fatal batch nor the one queued behind it may wait for ever.
        for outcome in await asyncio.gather(dying, behind, return_exceptions=True):
            assert isinstance(outcome, EngineError) and outcome.kind is Kind.WORKER_DEAD, outcome
        assert "behind" not in computed(handler)

    with TestClient(app) as client:
        assert client.get("/health/ready").status_code == 200
        client.portal.call(asyncio.wait_for, doomed(engine), 20)  # type: ignore[union-attr]
        live, ready = client.get("/health/live"), client.get("/health/ready")
        assert live.status_code == 503 and live.json()["status"] == "dead"
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        # The cause (here an exception's text quoting client input) is for the log and /admin, not the public.
        assert "die:now" not in ready.text + live.text and "SystemExit" in str(engine.worker_error)
        r = client.post("/predict", json={"texts": ["anyone?"]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead" and r.headers["Retry-After"]
        assert "inferd_worker_alive 0.0" in client.get("/metrics").text


def test_dimensions_other_than_the_model_s_are_refused_before_any_work(tmp_path: Path):
    """OpenAI's ``dimensions`` is the engine's rule: known from the model's description, refused unrun."""
    handler = HashHandler()
    kit = make_engine(tmp_path, handler)
    engine = kit.engine

    async def scenario() -> None:
        with pytest.raises(EngineError) as refused:
            await engine.process(engine.request(["a"], dimensions=handler.dimension + 1))
        assert (refused.value.kind, refused.value.field) == (Kind.INVALID_INPUT, "dimensions")
        assert f"{handler.dimension}-dimensional" in str(refused.value) and handler.batches == []
        assert (await engine.process(engine.request(["a"], dimensions=handler.dimension))).outputs == [vector_for("a")]

    kit.run(scenario)


def test_the_engine_builds_its_manager_with_the_callbacks_it_is_given(tmp_path: Path):
    """The manager is told its callbacks when it is built (the app's metrics, the lazy-failure exit)."""
    changes: list[list[str]] = []
    failures: list[str] = []
    settings = make_settings(tmp_path / "absent", model={"load_mode": "lazy", "exit_on_load_failure": True})

    def broken(spec: Any) -> Any:
        raise RuntimeError("no model here")

    kit = EngineKit(settings, broken, on_lazy_failure=failures.append,
                    on_change=lambda slots: changes.append([s.version for _, _, s in slots]))
    engine = kit.engine

    async def scenario() -> None:
        with pytest.raises(EngineError):
            await engine.process(engine.request(["a"]))
        assert len(failures) == 1 and "no model here" in failures[0] and changes == []

    kit.run(scenario)
    EngineKit(make_settings(tmp_path), HashHandler(),
              on_change=lambda slots: changes.append([s.version for _, _, s in slots]))
    assert changes == [["1"]]


def _served(tmp_path: Path, name: str, max_queue: int) -> ModelEntry:
    (tmp_path / name).mkdir(exist_ok=True)
    return ModelEntry(name=name, model=ModelSettings(name=name, path=str(tmp_path / name), warmup=False),
                      batching=BatchingSettings(max_wait_ms=0.0, max_batch_size=8, max_queue=max_queue))


def test_a_request_s_bound_is_the_largest_served_model_s_queue_as_the_models_change(tmp_path: Path):
    """``limits.max_queue`` is the queue's kept figure, not a scan: it must follow a model added, re-bounded and
    removed (SIGHUP), and a shadow lane's bound never counts."""
    handlers = {"a": HashHandler(), "b": HashHandler()}
    small, large = _served(tmp_path, "a", 8), _served(tmp_path, "b", 32)
    kit = EngineKit(make_settings(models=(small, large)), by_folder(handlers))
    engine = kit.engine
    engine.queue.add_lane("b#shadow", Policy(), 500, shadow=True)

    async def scenario() -> None:
        assert engine.limits.max_queue == 32
        with pytest.raises(EngineError) as refused:
            engine.request(["x"] * 33)
        assert refused.value.kind == Kind.INVALID_INPUT and "at most 32" in str(refused.value)
        assert len((await engine.process(engine.request(["x"] * 32, model="b"))).outputs) == 32
        await engine.reconfigure(make_settings(models=(small,)))
        assert engine.limits.max_queue == 8
        await engine.reconfigure(make_settings(models=(small, _served(tmp_path, "b", 16))))
        assert engine.limits.max_queue == 16
        await engine.reconfigure(make_settings(models=(_served(tmp_path, "a", 64), _served(tmp_path, "b", 16))))
        assert engine.limits.max_queue == 64

    kit.run(scenario)


# -- SIGHUP: each model's sections, part by part -----------------------------------------------------------------


def _sighup_kit(tmp_path: Path) -> tuple[EngineKit, dict[str, Any]]:
    """An engine serving m1 as v3 (model.root: tmp_path), each load a new HashHandler (one space); a folder named
    broken* fails to load, one named wide* has vectors of 16. Returns it and its settings' model section."""
    def make(spec: ModelSpec) -> HashHandler:
        if spec.path.name.startswith("broken"):
            raise RuntimeError("a broken model folder")
        handler = HashHandler()
        if spec.path.name.startswith("wide"):
            handler.dimension = 16
        return handler

    model = {"path": str(tmp_path / "m1"), "version": "v3", "root": [str(tmp_path)]}
    return EngineKit(make_settings(model=model), per_load(make)), model


def _roles(engine: InferenceEngine) -> list[tuple[str, str]]:
    return [(role, slot.version) for _, role, slot in engine.slots()]


def test_sighup_installs_reweights_replaces_and_drops_the_configured_canary(tmp_path: Path):
    kit, model = _sighup_kit(tmp_path)
    engine = kit.engine
    name = engine.manager.table.configured.name
    canary = {"path": str(tmp_path / "c1"), "version": "cv", "weight": 0.5}

    async def scenario() -> None:
        # The probe's: "version 'v3' is already being served by the active model", the model reloaded instead.
        assert await engine.reconfigure(make_settings(model=model, canary=canary)) == {name: "reloaded"}
        assert _roles(engine) == [("active", "v3"), ("canary", "cv")] and engine.manager.canary_weight == 0.5
        loads = len(kit.loaded)
        assert await engine.reconfigure(make_settings(model=model, canary={**canary, "weight": 0.2})) == {
            name: "updated"}
        assert engine.manager.canary_weight == 0.2 and len(kit.loaded) == loads
        # A new model and a new canary together: the model first, the canary measured against it.
        v4 = {**model, "path": str(tmp_path / "m2"), "version": "v4"}
        both = make_settings(model=v4, canary={**canary, "path": str(tmp_path / "c2"), "version": "cv2"})
        assert await engine.reconfigure(both) == {name: "reloaded"}
        assert _roles(engine) == [("active", "v4"), ("canary", "cv2")]
        assert await engine.reconfigure(make_settings(model=v4)) == {name: "updated"}
        assert _roles(engine) == [("active", "v4")]
        assert await engine.reconfigure(make_settings(model=v4, batching={"max_batch_size": 4})) == {name: "updated"}
        assert engine.registry.first().entry.batching.max_batch_size == 4  # type: ignore[union-attr]

    kit.run(scenario)


def test_a_failed_sighup_change_is_tried_again_and_never_holds_back_the_rest(tmp_path: Path):
    kit, model = _sighup_kit(tmp_path)
    engine = kit.engine
    served = engine.registry.first()
    assert served is not None
    broken = {"path": str(tmp_path / "broken-c"), "version": "cv", "weight": 0.5}

    async def scenario() -> None:
        assert await engine.reconfigure(make_settings(model=model, canary=broken)) == {served.name: "failed"}
        # Still named, still broken: tried again and refused again; the batching edit beside it applies all the same.
        again = make_settings(model=model, canary=broken, batching={"max_batch_size": 4})
        assert await engine.reconfigure(again) == {served.name: "failed"}
        assert served.entry.batching.max_batch_size == 4 and _roles(engine) == [("active", "v3")]
        # A new path under the served version: refused (version_in_use); the canary waits for its model.
        same_version = make_settings(model={**model, "path": str(tmp_path / "m2")},
                                     canary={**broken, "path": str(tmp_path / "c1")})
        assert await engine.reconfigure(same_version) == {served.name: "failed"}
        assert _roles(engine) == [("active", "v3")] and served.entry.model.path == model["path"]
        # The configuration put right: the model and its canary change.
        fixed = make_settings(model={**model, "path": str(tmp_path / "m2"), "version": "v4"},
                              canary={**broken, "path": str(tmp_path / "c1")})
        assert await engine.reconfigure(fixed) == {served.name: "reloaded"}
        assert _roles(engine) == [("active", "v4"), ("canary", "cv")]

    kit.run(scenario)


def test_sighup_rules_of_change_follow_without_a_reload_and_start_keys_wait_for_a_restart(tmp_path: Path):
    kit, model = _sighup_kit(tmp_path)
    engine, manager = kit.engine, kit.engine.manager
    served = engine.registry.first()
    assert served is not None
    elsewhere = tmp_path / "elsewhere"
    fresh = make_settings(model={**model, "root": [str(elsewhere)], "allow_dimension_change": True,
                                 "load_timeout_s": 7.0, "load_mode": "lazy"})

    async def scenario() -> None:
        assert engine.start_only(fresh) == ["model.load_mode"]
        # The probe's: "v3 is already being served" (a reload was tried), or else nothing taken at all.
        assert await engine.reconfigure(fresh) == {served.name: "updated"}
        assert len(kit.loaded) == 1 and manager.roots == [elsewhere.resolve()]
        assert manager.rollout.change_lock.timeout_s == 7.0 and served.settings.model.load_mode == "eager"
        slot = await asyncio.to_thread(manager.reload, str(elsewhere / "wide"), "v4")  # under the new root, 16 wide
        assert manager.active is slot and slot.description.dimension == 16
        # Taken with a reload too (the probe's "reloaded", the old root kept).
        third = tmp_path / "third"
        renamed = make_settings(model={**model, "version": "v5", "root": [str(third)], "allow_dimension_change": True})
        assert await engine.reconfigure(renamed) == {served.name: "reloaded"}
        assert manager.roots == [third.resolve()] and _roles(engine) == [("active", "v5")]

    kit.run(scenario)


def test_a_request_s_model_is_resolved_once(tmp_path: Path):
    """The engine resolves a request's model once and hands it on (to the default chunking and to admission); an
    unknown model is still refused by admission, in its own order."""
    handler = HashHandler()
    kit = make_engine(tmp_path, handler)
    engine = kit.engine
    calls: list[tuple[Any, ...]] = []
    resolve = engine.registry.resolve

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return resolve(*args, **kw)

    engine.registry.resolve = counted  # type: ignore[method-assign]

    async def scenario() -> None:
        result = await engine.process(engine.request(["one text", "and another"]))
        assert result.outputs == [vector_for("one text"), vector_for("and another")]
        assert len(calls) == 1
        with pytest.raises(EngineError) as refused:
            await engine.process(engine.request(["x"], model="nope"))
        assert refused.value.kind is Kind.MODEL_NOT_FOUND

    kit.run(scenario)
