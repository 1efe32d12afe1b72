"""The engine's safety properties, in-process with fake handlers: which thread writes a request's outcome,
which thread frees a model, that a batch keeps its model alive, that the cache never crosses models, and
that thread-pool tokenisation is bounded.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from enginekit import EngineKit, hold, per_load, until
from fakes import HashHandler, vector_for
from settingskit import make_settings

from inferd.core import admission
from inferd.core.errors import ClientGone, EngineError, Kind
from inferd.core.outcomes import Ticket
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec


class Salted(HashHandler):
    """A distinct model per folder: its vectors are vector_for(folder name + text). Records, per infer,
    whether it had been closed, and the thread that closed it."""

    def __init__(self, salt: str) -> None:
        super().__init__()
        self.salt = salt
        self.closed_at_infer: list[bool] = []
        self.closed_by: str | None = None

    def infer(self, batch: list[Encoded]) -> list[str]:
        self.closed_at_infer.append(self.closed)
        return super().infer(batch)

    def postprocess(self, outputs: list[str]) -> list[list[float]]:
        return [vector_for(self.salt + t) for t in outputs]

    def close(self) -> None:
        self.closed_by = threading.current_thread().name
        super().close()


def make(tmp_path: Path, cache: int = 0, **limits: Any) -> tuple[EngineKit, dict[str, Salted]]:
    """An engine over folder ``a`` (v1) under ``tmp_path``, and each folder's Salted handler, made at its load."""
    settings = make_settings(tmp_path / "a", model={"version": "v1", "root": [str(tmp_path)]},
                             cache={"max_entries": cache}, limits=limits)
    models: dict[str, Salted] = {}

    def salted(spec: ModelSpec) -> Salted:
        handler = models[spec.path.name] = Salted(spec.path.name)
        return handler

    return EngineKit(settings, per_load(salted)), models


def test_a_batch_taken_from_the_queue_keeps_its_model_until_it_has_run(tmp_path: Path):
    # The worker has taken a batch; before it runs, the model is replaced and the only client leaves.
    # The batch's own claim keeps the model loaded: it is never run on (or freed under) a closed model.
    kit, models = make(tmp_path)
    engine, manager = kit.engine, kit.engine.manager
    old = models["a"]
    taken, go = threading.Event(), threading.Event()
    worker = engine.worker.all()[0]  # the model's one instance
    handle = worker._handle

    def paused(decision: Any, *staged: Any) -> None:
        if decision.batch:
            taken.set()
            go.wait(10)
        handle(decision, *staged)

    worker._handle = paused  # type: ignore[method-assign]

    async def scenario() -> None:
        gone = asyncio.Event()
        victim = asyncio.ensure_future(engine.process(engine.request(["victim"]), disconnected=gone.wait))
        await until(taken.is_set)
        await asyncio.to_thread(manager.reload, str(tmp_path / "b"), "v2")
        gone.set()
        with pytest.raises(ClientGone):
            await victim
        assert not old.closed  # the request let go; the taken batch still holds the model
        go.set()
        await until(lambda: old.closed)  # freed once the batch is done with it
        assert True not in old.closed_at_infer
        assert (await engine.process(engine.request(["next"]))).outputs == [vector_for("b" + "next")]

    kit.run(scenario)


def test_only_the_event_loop_writes_a_requests_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A 504 set by the loop must not be overwritten by the worker's 500/507: one writer, the loop.
    writers: list[tuple[str, int]] = []

    class Watched(Ticket):
        def __setattr__(self, name: str, value: Any) -> None:
            if name in ("closed", "error", "remaining", "results"):
                writers.append((name, threading.get_ident()))
            super().__setattr__(name, value)

    monkeypatch.setattr(admission, "Ticket", Watched)  # where tickets are made
    kit, models = make(tmp_path)
    engine = kit.engine
    handler = models["a"]
    oom = {"oom:x"}
    infer = handler.infer

    def infer_or_oom(batch: list[Encoded]) -> list[str]:
        if any("".join(map(chr, e.ids)) in oom for e in batch):
            raise torch.OutOfMemoryError("fake: out of memory")
        return infer(batch)

    handler.infer = infer_or_oom  # type: ignore[method-assign]

    async def scenario() -> None:
        loop_thread = threading.get_ident()
        ok = await engine.process(engine.request(["one", "two", "three"]))
        assert ok.outputs == [vector_for("a" + t) for t in ("one", "two", "three")]
        for texts, kind in ((["fail:x"], Kind.FAILED), (["oom:x"], Kind.OOM)):
            with pytest.raises(EngineError) as info:
                await engine.process(engine.request(texts))
            assert info.value.kind is kind
        held = await hold(engine, handler, "g")
        with pytest.raises(EngineError) as info:  # expires while queued behind the held batch
            await engine.process(engine.request(["late"], timeout_ms=30))
        assert info.value.kind is Kind.DEADLINE
        handler.gates["g"].set()
        await held
        assert writers and {thread for _, thread in writers} == {loop_thread}

    kit.run(scenario)


def test_a_models_last_release_frees_it_on_the_worker_not_the_event_loop(tmp_path: Path):
    kit, models = make(tmp_path)
    engine, manager = kit.engine, kit.engine.manager
    old = models["a"]
    old.gates["g"] = threading.Event()

    async def scenario() -> None:
        held = asyncio.ensure_future(engine.process(engine.request(["hold:g"])))
        await until(lambda: old.batches)
        await asyncio.to_thread(manager.reload, str(tmp_path / "b"), "v2")
        assert not old.closed  # a request still runs on it
        old.gates["g"].set()
        await held  # the request's release, on the loop, is the last one
        await until(lambda: old.closed)
        assert old.closed_by.startswith("inferd-worker")  # the model's instance

    kit.run(scenario)


def test_the_cache_never_answers_with_another_models_vectors(tmp_path: Path):
    # v1 is freed for good once v2 replaces it, so the label may serve again: for another model (c).
    kit, _ = make(tmp_path, cache=100)
    engine, manager = kit.engine, kit.engine.manager

    async def vector(text: str) -> tuple[str, list[float]]:
        result = await engine.process(engine.request([text]))
        return result.version, [float(v) for v in result.outputs[0]]  # a cache hit is a numpy array

    async def scenario() -> None:
        assert await vector("x") == ("v1", vector_for("ax"))
        assert await vector("x") == ("v1", vector_for("ax"))  # a hit, same model
        assert engine.metrics.registry.get_sample_value("inferd_cache_hits_total",
                                                      {"cache": engine.registry.first().name}) == 1
        await asyncio.to_thread(manager.reload, str(tmp_path / "b"), "v2")
        await asyncio.to_thread(manager.reload, str(tmp_path / "c"), "v1")
        assert await vector("x") == ("v1", vector_for("cx"))

    kit.run(scenario)


def test_tokenising_in_the_thread_pool_runs_one_request_at_a_time(tmp_path: Path):
    kit, models = make(tmp_path, preprocess_concurrency=1)
    engine = kit.engine
    handler = models["a"]
    state = {"active": 0, "peak": 0, "entered": 0}
    lock, gate = threading.Lock(), threading.Event()
    preprocess = handler.preprocess

    def slow(texts: list[str]) -> list[Encoded]:
        with lock:
            state["active"] += 1
            state["entered"] += 1
            state["peak"] = max(state["peak"], state["active"])
        try:
            gate.wait(10)
            return preprocess(texts)
        finally:
            with lock:
                state["active"] -= 1

    handler.preprocess = slow  # type: ignore[method-assign]
    long_texts = [[f"{i} " + "w" * 5000] for i in range(3)]  # past the inline limit: the thread pool

    async def scenario() -> None:
        tasks = [asyncio.ensure_future(engine.process(engine.request(t))) for t in long_texts]
        await until(lambda: engine.in_flight == 3 and state["entered"] >= 1)
        await asyncio.sleep(0.2)  # room for the others to start tokenising, if they could
        assert state["entered"] == 1
        gate.set()
        results = await asyncio.gather(*tasks)
        assert [r.outputs for r in results] == [[vector_for("a" + t[0])] for t in long_texts]
        assert state["peak"] == 1 and state["entered"] == 3

    kit.run(scenario)
