"""Model instances (core/instances.py, core/worker.py Workers): batches of different models, and a model's
shadow, run at the same time on workers of their own, each with its own threads (or CUDA stream).

Batches are held with the fake's in-process gates (``hold:NAME``, tests/fakes.py), so a test sees two batches
running at the same moment instead of timing them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import wait_for
from enginekit import EngineKit, ask, by_folder, until
from fakes import HashHandler, encode, loader_for, opened, vector_for
from settingskit import make_settings
from starlette.testclient import TestClient

from inferd.api.app import create_app
from inferd.core.backends.base import GraphRunner, all_threads, options_for, running_alone
from inferd.core.backends.torch import TorchRunner
from inferd.core.batcher import BatchQueue
from inferd.core.budgets import instance_counts, thread_budgets, with_budgets
from inferd.core.capabilities import Capabilities
from inferd.core.errors import EngineError, Kind
from inferd.core.instances import Instance, Sharing, live_lane
from inferd.core.outcomes import Outcome, Ticket, WorkItem
from inferd.core.scheduler import Policy
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec, spec_from_settings
from inferd.core.worker import BatchWorker
from inferd.settings import BatchingSettings, ModelEntry, ModelSettings
from inferd.utils.metrics import Metrics


class ThreadsHandler(HashHandler):
    """Records the intra-op thread count torch reports on the thread that runs each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def infer(self, batch: list[Any]) -> list[str]:
        self.threads.append(torch.get_num_threads())
        return super().infer(batch)


def entry(tmp_path: Path, name: str, batch: int = 32, **model: Any) -> ModelEntry:
    (tmp_path / name).mkdir(exist_ok=True)
    return ModelEntry(name=name, model=ModelSettings(name=name, path=str(tmp_path / name), warmup=False,
                                                     load_mode="eager", **model),
                      batching=BatchingSettings(max_wait_ms=0.0, max_batch_size=batch, max_queue=64))


def engine_of(tmp_path: Path, handlers: dict[str, HashHandler], entries: list[ModelEntry]) -> EngineKit:
    """An engine serving these models, each folder's handler the one ``handlers`` names."""
    return EngineKit(make_settings(models=tuple(entries)), by_folder(handlers))


def test_two_models_batches_run_at_the_same_moment(tmp_path: Path) -> None:
    handlers = {"a": HashHandler(), "b": HashHandler()}
    kit = engine_of(tmp_path, handlers, [entry(tmp_path, "a"), entry(tmp_path, "b")])
    engine = kit.engine

    async def scenario() -> None:
        for name, handler in handlers.items():
            handler.gates[name] = threading.Event()
        held_a = ask(engine, ["hold:a"], model="a")
        held_b = ask(engine, ["hold:b"], model="b")
        # Both batches are inside their handlers at once: neither waits for the other to finish.
        await until(lambda: handlers["a"].batches == [["hold:a"]] and handlers["b"].batches == [["hold:b"]])
        handlers["b"].gates["b"].set()
        assert (await held_b).outputs == [vector_for("hold:b")]
        assert not held_a.done()  # a's batch still runs: b's was answered beside it
        handlers["a"].gates["a"].set()
        assert (await held_a).outputs == [vector_for("hold:a")]
        busy = {m: engine.metrics.registry.get_sample_value("inferd_instance_batches_total",
                                                            {"model": m, "instance": "0"}) for m in "ab"}
        assert busy == {"a": 1.0, "b": 1.0}

    kit.run(scenario)


def test_a_model_s_instances_run_its_batches_at_the_same_time(tmp_path: Path) -> None:
    handlers = {"a": HashHandler()}
    kit = engine_of(tmp_path, handlers, [entry(tmp_path, "a", batch=1, instances=2)])
    engine = kit.engine

    async def scenario() -> None:
        handlers["a"].gates["x"] = threading.Event()
        held = [ask(engine, ["hold:x one"], model="a"), ask(engine, ["hold:x two"], model="a")]
        await until(lambda: len(handlers["a"].batches) == 2)  # two batches of one model held together
        handlers["a"].gates["x"].set()
        assert [r.outputs for r in await asyncio.gather(*held)] == [[vector_for("hold:x one")],
                                                                    [vector_for("hold:x two")]]

    kit.run(scenario)


def test_a_live_request_is_answered_while_a_shadow_batch_is_held(tmp_path: Path) -> None:
    handlers = {"a": HashHandler(), "cand": HashHandler()}
    kit = engine_of(tmp_path, handlers, [entry(tmp_path, "a")])
    engine = kit.engine
    (tmp_path / "cand").mkdir()
    engine.manager.set_shadow(str(tmp_path / "cand"), "v2", 1.0)

    async def scenario() -> None:
        handlers["a"].gates["s"] = threading.Event()
        handlers["a"].gates["s"].set()  # the live model passes the gate; its mirrored copy is held on the candidate
        handlers["cand"].gates["s"] = threading.Event()
        await ask(engine, ["hold:s"])
        await until(lambda: handlers["cand"].batches == [["hold:s"]])
        # The shadow batch holds its instance; live work runs on the model's own.
        assert (await ask(engine, ["live"])).outputs == [vector_for("live")]
        assert handlers["cand"].batches == [["hold:s"]]
        handlers["cand"].gates["s"].set()

    kit.run(scenario)


def test_each_instance_runs_with_its_own_torch_thread_count(tmp_path: Path) -> None:
    previous = torch.get_num_threads()
    handlers: dict[str, HashHandler] = {"one": ThreadsHandler(), "two": ThreadsHandler()}
    kit = engine_of(tmp_path, handlers, [entry(tmp_path, "one", threads=1), entry(tmp_path, "two", threads=2)])
    engine = kit.engine

    async def scenario() -> None:
        for _ in range(3):
            await asyncio.gather(ask(engine, ["x"], model="one"), ask(engine, ["y"], model="two"))
        assert handlers["one"].threads == [1, 1, 1]  # type: ignore[attr-defined]
        assert handlers["two"].threads == [2, 2, 2]  # type: ignore[attr-defined]

    try:
        kit.run(scenario)
    finally:
        torch.set_num_threads(previous)


class GraphThreadsHandler(ThreadsHandler):
    """A handler whose pass computes on a compiled graph's own threads (``Capabilities.torch_threads`` False)."""

    capabilities = Capabilities(torch_threads=False)


def test_a_compiled_graph_s_batch_does_its_torch_work_on_one_thread_and_a_torch_batch_on_its_instance_s(
        tmp_path: Path) -> None:
    # The torch work around a graph's pass (collate, pooling) on one thread wakes no second OpenMP thread to spin
    # beside the runtime's own; a torch model's batch on the same worker thread gets the instance's count back.
    previous = torch.get_num_threads()
    instance = Instance("m", 0, 2, live_lane("m"))
    counts: list[int] = []

    def on_worker() -> None:
        for torch_compute in (True, False, False, True):
            instance.apply_threads(torch_compute)
            counts.append(torch.get_num_threads())

    worker = threading.Thread(target=on_worker)
    worker.start()
    worker.join(10)
    assert counts == [2, 1, 1, 2]
    handlers: dict[str, HashHandler] = {"graph": GraphThreadsHandler(), "torch": ThreadsHandler()}
    kit = engine_of(tmp_path, handlers, [entry(tmp_path, "graph", threads=2), entry(tmp_path, "torch", threads=2)])

    async def scenario() -> None:
        for _ in range(2):
            await asyncio.gather(ask(kit.engine, ["x"], model="graph"), ask(kit.engine, ["y"], model="torch"))
        assert handlers["graph"].threads == [1, 1]  # type: ignore[attr-defined]
        assert handlers["torch"].threads == [2, 2]  # type: ignore[attr-defined]

    try:
        kit.run(scenario)
    finally:
        torch.set_num_threads(previous)


def test_the_cores_are_split_between_every_instance_unless_a_model_sets_its_own(tmp_path: Path) -> None:
    a, b = entry(tmp_path, "a"), entry(tmp_path, "b", instances=2)
    assert thread_budgets((a, b), 6) == {"a": 2, "b": 2}
    assert thread_budgets((a,), 2) == {"a": 2}
    assert thread_budgets((entry(tmp_path, "a", threads=4), b), 8) == {"a": 4, "b": 2}
    # More instances than cores: one thread each (they time-share), never none.
    assert thread_budgets((a, b), 2) == {"a": 1, "b": 1}
    resolved = with_budgets(make_settings(models=(a, b)), cores=6)
    assert [e.model.threads for e in resolved.models] == [2, 2]
    single = with_budgets(make_settings(tmp_path / "a"), cores=3)
    assert single.model.threads == 3 and single.served()[0].model.threads == 3


def test_instances_0_is_one_openvino_instance_per_core_of_the_model_s_share_and_one_torch_instance(
        tmp_path: Path) -> None:
    auto, other = entry(tmp_path, "a", instances=0, backend="openvino"), entry(tmp_path, "b", instances=0,
                                                                              backend="openvino")
    assert instance_counts((auto,), 4) == {"a": 4} and thread_budgets((auto,), 4) == {"a": 1}
    assert instance_counts((auto, other), 4) == {"a": 2, "b": 2}
    assert instance_counts((auto, other), 1) == {"a": 1, "b": 1}  # never none
    assert instance_counts((entry(tmp_path, "a", instances=0, threads=2, backend="openvino"),), 4) == {"a": 2}
    # torch (and ONNX Runtime): one instance of every thread of its share, which served more on torch.
    torch_auto = entry(tmp_path, "t", instances=0)
    assert instance_counts((torch_auto,), 4) == {"t": 1} and thread_budgets((torch_auto,), 4) == {"t": 4}
    assert instance_counts((torch_auto, other), 4) == {"t": 1, "b": 2}
    resolved = with_budgets(make_settings(models=(auto, entry(tmp_path, "b", instances=1))), cores=4)
    # Three instances on four cores: one thread each, the fourth core left to the event loop and the tokenizer.
    assert [(e.model.instances, e.model.threads) for e in resolved.models] == [(2, 1), (1, 1)]


class FakeStream:
    """Stands for a CUDA stream on the CPU: a context that records what ran inside it, and on which thread."""

    def __init__(self) -> None:
        self.active = threading.local()
        self.entered = 0

    def __enter__(self) -> FakeStream:
        self.active.on = True
        self.entered += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.active.on = False


class StreamHandler(HashHandler):
    def __init__(self, streams: list[FakeStream]) -> None:
        super().__init__()
        self.streams = streams
        self.seen: list[tuple[str, list[int]]] = []

    def infer(self, batch: list[Any]) -> list[str]:
        self.seen.append(("infer", [i for i, s in enumerate(self.streams) if getattr(s.active, "on", False)]))
        return super().infer(batch)

    def postprocess(self, outputs: list[str]) -> list[list[float]]:
        self.seen.append(("post", [i for i, s in enumerate(self.streams) if getattr(s.active, "on", False)]))
        return super().postprocess(outputs)


@contextmanager
def workers_on(queue: BatchQueue, instances: list[Instance]) -> Iterator[list[Outcome]]:
    outcomes: list[Outcome] = []
    workers = [BatchWorker(queue, Metrics(), None, outcomes.append, instance) for instance in instances]
    for worker in workers:
        worker.start()
    try:
        yield outcomes
    finally:
        for worker in workers:
            worker.retire()
        for worker in workers:
            assert worker.thread is not None
            worker.thread.join(5)


def test_on_a_gpu_each_instance_runs_its_batch_and_the_copy_out_on_its_own_stream(tmp_path: Path) -> None:
    streams = [FakeStream(), FakeStream()]
    handler = StreamHandler(streams)
    slot = ModelSlot(opened(handler, ModelSpec(tmp_path, "1")), ModelSpec(tmp_path, "1"), 0.0)
    queue = BatchQueue(claim=lambda b: b[0].slot.acquire())
    queue.add_lane("m", Policy(max_batch_size=1, max_wait_ms=0.0), 64)
    handler.gates["g"] = threading.Event()
    instances = [Instance("m", i, 1, live_lane("m"), stream) for i, stream in enumerate(streams)]
    loop = asyncio.new_event_loop()
    try:
        with workers_on(queue, instances) as outcomes:
            now = time.monotonic()
            for text in ("hold:g a", "hold:g b"):
                ticket = Ticket(loop.create_future(), 1)
                queue.put([WorkItem(ticket, 0, encode(text), len(text), 0, now, now + 60, queue.next_seq(), slot)],
                          "m")
            wait_for(lambda: len(handler.batches) >= 2, 10, every=0.002)
            handler.gates["g"].set()
            wait_for(lambda: len(outcomes) >= 2, 10, every=0.002)
    finally:
        loop.close()
    assert len(outcomes) == 2
    # Both batches were in flight together, each inside exactly one stream, the postprocess (the copy to the
    # host) on the stream its forward pass ran on; the two instances used different streams.
    assert sorted(s.entered for s in streams) == [1, 1]
    by_step = [(step, on) for step, on in handler.seen]
    assert all(len(on) == 1 for _, on in by_step)
    assert {tuple(on) for step, on in by_step if step == "infer"} == {(0,), (1,)}


def test_the_instances_budget_reaches_the_graph_runtimes_options(tmp_path: Path) -> None:
    settings = with_budgets(make_settings(models=(entry(tmp_path, "a", instances=2, backend="openvino"),)), cores=4)
    options = options_for(spec_from_settings(settings.for_model(settings.models[0])))
    assert (options.threads, options.streams) == (4, 2)  # two instances of two threads, in one compiled model


def test_an_openvino_model_of_two_instances_runs_two_streams_one_request_per_thread(tmp_path: Path) -> None:
    import openvino as ov
    import openvino.opset13 as ops

    from inferd.core.backends.openvino import OpenVINORunner

    ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    ov.save_model(ov.Model([ops.convert(ops.multiply(ids, mask), ov.Type.f32)], [ids, mask]), tmp_path / "g.xml")
    runner = OpenVINORunner(tmp_path / "g.xml", "hidden", "float32", "none", threads=2, streams=2)
    assert int(runner._compiled.get_property("NUM_STREAMS")) == 2  # noqa: SLF001
    barrier, seen, wrong = threading.Barrier(2), {}, []

    def run(k: int) -> None:
        barrier.wait()
        for i in range(200):  # both threads inside the runtime at once, the shapes changing under each
            rows, cols = 1 + (i + k) % 5, 1 + (i * k) % 9
            feed = {"input_ids": np.full((rows, cols), k, np.int64), "attention_mask": np.ones((rows, cols), np.int64)}
            out = runner._run(feed)  # noqa: SLF001
            if out.tolist() != [[float(k)] * cols] * rows:
                wrong.append((k, i, out.shape))
        seen[k] = runner._requests.request  # noqa: SLF001

    # Daemon threads: a deadlock inside the runtime fails the test (not joined) instead of hanging the suite.
    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "two threads running one OpenVINO model at once did not finish"
    assert wrong == [] and set(seen) == {1, 2}
    assert seen[1] is not seen[2]  # a request is not shared between threads that run at once
    # A column slice is not contiguous: the runner hands the runtime contiguous arrays of its own.
    sliced = {"input_ids": np.full((2, 6), 3, np.int64)[:, :3], "attention_mask": np.ones((2, 6), np.int64)[:, :3]}
    assert runner._run(sliced).tolist() == [[3.0] * 3] * 2  # noqa: SLF001


def test_v1_models_and_admin_models_show_each_model_s_instances(tmp_path: Path) -> None:
    handler = HashHandler()
    settings = make_settings(tmp_path / "m", model={"instances": 2, "threads": 1}, server={"admin_key": "k"})
    (tmp_path / "m").mkdir()
    with TestClient(create_app(settings, loader=loader_for(handler))) as client:
        assert client.post("/embed", json={"inputs": "x"}).status_code == 200
        (listed,) = client.get("/v1/models").json()["data"]
        assert (listed["instances"], listed["threads_per_instance"]) == (2, 1)
        admin = client.get("/admin/models", headers={"Authorization": "Bearer k"}).json()
        (row,) = admin["models"]
        assert [(i["index"], i["threads"], i["stream"]) for i in row["instances"]] == [(0, 1, False), (1, 1, False)]
        assert sum(i["batches"] for i in row["instances"]) == 1
        assert admin["shadow_instance"]["index"] == "shadow"


def test_the_bench_takes_each_ratio_within_a_round() -> None:
    from inferd.bench.instances import arrangements, instances_markdown, summarise

    names = [a[0] for a in arrangements(2)]
    assert names == ["1x2", "2x1"]
    rounds = [{"torch": {"32": {"1x2": {"texts_per_s": 100.0, "p50_ms": 5.0, "p99_ms": 20.0},
                                "2x1": {"texts_per_s": 120.0, "p50_ms": 5.0, "p99_ms": 10.0}}}},
              {"torch": {"32": {"1x2": {"texts_per_s": 50.0, "p50_ms": 5.0, "p99_ms": 40.0},
                                "2x1": {"texts_per_s": 50.0, "p50_ms": 5.0, "p99_ms": 40.0}}}}]
    summary = summarise(rounds, ["torch"], [32], names)
    # Per round 1.2 and 1.0 (a slow second round does not move the first's ratio): median 1.1.
    assert summary["torch @ 32"]["ratio"]["texts_per_s"] == {"median": 1.1, "min": 1.0, "max": 1.2}
    assert summary["torch @ 32"]["ratio"]["p99_ms"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    table = instances_markdown({"arrangements": names, "rounds": rounds, "summary": summary})
    assert "| torch @ 32 | 75 (50-100) | 85 (50-120) | 1.1 (1-1.2) |" in table


class OomHandler(HashHandler):
    """Out of memory on any batch holding an ``oom`` text with anything else, and on that text alone."""

    def infer(self, batch: list[Any]) -> list[str]:
        texts = super().infer(batch)
        if any(t.startswith("oom") for t in texts):
            raise torch.OutOfMemoryError("fake: out of memory")
        return texts


def test_an_instance_out_of_memory_splits_its_own_batch_and_leaves_the_other_running(tmp_path: Path) -> None:
    handlers: dict[str, HashHandler] = {"a": OomHandler(), "b": HashHandler()}
    kit = engine_of(tmp_path, handlers, [entry(tmp_path, "a"), entry(tmp_path, "b")])
    engine = kit.engine

    async def scenario() -> None:
        handlers["b"].gates["b"] = threading.Event()
        held = ask(engine, ["hold:b"], model="b")
        await until(lambda: handlers["b"].batches == [["hold:b"]])
        with pytest.raises(EngineError) as info:
            await ask(engine, ["xyz", "oom"], model="a")  # runs while b's batch is held: whole, then halves
        assert info.value.kind is Kind.OOM and handlers["a"].batches == [["xyz", "oom"], ["xyz"], ["oom"]]
        assert not held.done()  # b's instance never saw a's failure
        handlers["b"].gates["b"].set()
        assert (await held).outputs == [vector_for("hold:b")]

    kit.run(scenario)


def test_the_fleet_layout_shows_each_worker_s_instances(tmp_path: Path) -> None:
    from inferd.fleet.layout import plan as fleet_plan

    models = (entry(tmp_path, "embedder", instances=0, backend="openvino"), entry(tmp_path, "reranker", instances=1))
    ports = iter(range(20000, 20100))
    layout = fleet_plan(make_settings(models=models, fleet={"workers": 2}), [], cores=8, port=lambda: next(ports))
    # Each worker's 4 threads: the embedder's share of 2 cores as two one-thread instances, the reranker's one
    # instance the rest of the even split.
    assert [w.instances for w in layout.workers] == ["embedder 2x1, reranker 1x1"] * 2
    assert "embedder 2x1, reranker 1x1" in layout.table()


def test_a_reload_moves_every_instance_of_the_model_to_the_new_load(tmp_path: Path) -> None:
    handlers: dict[str, HashHandler] = {"a": HashHandler(), "b": HashHandler()}
    (tmp_path / "b").mkdir()
    only = entry(tmp_path, "a", batch=1, instances=2, root=(str(tmp_path),))
    kit = engine_of(tmp_path, handlers, [only])
    engine = kit.engine

    async def scenario() -> None:
        await asyncio.to_thread(engine.manager.reload, str(tmp_path / "b"), "v2")
        handlers["b"].gates["r"] = threading.Event()
        held = [ask(engine, ["hold:r one"]), ask(engine, ["hold:r two"])]
        # Both instances hold a batch of the new load at once; the old load computes nothing more.
        await until(lambda: len(handlers["b"].batches) == 2)
        handlers["b"].gates["r"].set()
        assert {r.version for r in await asyncio.gather(*held)} == {"v2"}
        assert handlers["a"].batches == []

    kit.run(scenario)


# -- a GPU instance's overlap: the next batch staged while the current one runs (core/staging.py) ---------------


class FakeCudaStream(FakeStream):
    """A copy or compute stream: events recorded on it, and the events it was told to wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[object] = []
        self.waited: list[object] = []

    def record_event(self) -> object:
        event = object()
        self.recorded.append(event)
        return event

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class StagingHandler(HashHandler):
    """Stages a batch as the torch task does (a StagedBatch over its copies), recording what was staged while
    which batch ran, and what each infer was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.running: str | None = None
        self.staged: list[tuple[list[str], str | None]] = []
        self.handed: list[Any] = []

    def stage(self, batch: list[Any], copy: Any, compute: Any) -> list[Any]:
        from inferd.core.staging import StagedBatch, to_device

        self.staged.append(([decode_text(e) for e in batch], self.running))
        tensors, event = to_device((torch.tensor([len(batch)]),), torch.device("cpu"), copy)
        return StagedBatch(batch, tensors, event, compute)

    def infer(self, batch: list[Any]) -> list[str]:
        self.handed.append(batch)
        self.running = decode_text(batch[0])
        try:
            return super().infer(batch)
        finally:
            self.running = None


def decode_text(e: Any) -> str:
    return "".join(map(chr, e.ids))


def put(queue: BatchQueue, loop: asyncio.AbstractEventLoop, slot: ModelSlot, text: str) -> Ticket:
    now = time.monotonic()
    ticket = Ticket(loop.create_future(), 1)
    queue.put([WorkItem(ticket, 0, encode(text), len(text), 0, now, now + 60, queue.next_seq(), slot)], "m")
    return ticket


def test_on_a_gpu_the_next_batch_is_taken_and_copied_while_the_current_one_runs(tmp_path: Path) -> None:
    from inferd.core.staging import StagedBatch

    compute, copy = FakeCudaStream(), FakeCudaStream()
    handler = StagingHandler()
    handler.gates["g"] = threading.Event()
    slot = ModelSlot(opened(handler, ModelSpec(tmp_path, "1")), ModelSpec(tmp_path, "1"), 0.0)
    queue = BatchQueue(claim=lambda b: b[0].slot.acquire())
    queue.add_lane("m", Policy(max_batch_size=1, max_wait_ms=0.0), 64)
    instance = Instance("m", 0, 1, live_lane("m"), compute, copy_stream=copy)
    loop = asyncio.new_event_loop()
    try:
        with workers_on(queue, [instance]) as outcomes:
            put(queue, loop, slot, "hold:g first")
            wait_for(lambda: handler.batches, 10, every=0.002)
            put(queue, loop, slot, "second")
            put(queue, loop, slot, "third")
            # While "first" is held inside infer, the stager takes "second" and stages it, and no further.
            wait_for(lambda: len(handler.staged) >= 2, 10, every=0.002)
            time.sleep(0.05)
            staged_while_held = list(handler.staged)
            handler.gates["g"].set()
            wait_for(lambda: len(outcomes) >= 3, 10, every=0.002)
    finally:
        loop.close()
    assert staged_while_held == [(["hold:g first"], None), (["second"], "hold:g first")]
    assert [texts for texts, _ in handler.staged] == [["hold:g first"], ["second"], ["third"]]
    assert len(outcomes) == 3 and [b for b in handler.batches] == [["hold:g first"], ["second"], ["third"]]
    # infer got each staged batch; each copy recorded its event on the copy stream, which the compute stream
    # waits for only when the task takes the inputs (not by the worker: a handler that stages nothing waits
    # for nothing).
    assert all(isinstance(b, StagedBatch) and b.compute is compute for b in handler.handed)
    assert [b.event for b in handler.handed] == copy.recorded and compute.waited == []


def test_without_a_copy_stream_nothing_is_staged(tmp_path: Path) -> None:
    handler = StagingHandler()
    slot = ModelSlot(opened(handler, ModelSpec(tmp_path, "1")), ModelSpec(tmp_path, "1"), 0.0)
    queue = BatchQueue(claim=lambda b: b[0].slot.acquire())
    queue.add_lane("m", Policy(max_batch_size=1, max_wait_ms=0.0), 64)
    loop = asyncio.new_event_loop()
    try:
        with workers_on(queue, [Instance("m", 0, 1, live_lane("m"), FakeCudaStream())]) as outcomes:
            put(queue, loop, slot, "only")
            wait_for(lambda: outcomes, 10, every=0.002)
    finally:
        loop.close()
    assert handler.staged == [] and [type(b) for b in handler.handed] == [list]


def test_a_torch_task_takes_its_staged_inputs_after_the_copy_and_only_on_a_gpu() -> None:
    from inferd.core.staging import StagedBatch, same_batch
    from inferd.core.tasks.embedding import EmbeddingHandler

    task = EmbeddingHandler.__new__(EmbeddingHandler)
    task.pad_id, task.segments = 0, False
    batch = [encode("ab"), encode("abcd")]
    compute, copy = FakeCudaStream(), FakeCudaStream()
    # Its runner's capabilities say whether it stages (torch's on a CUDA device only): a CPU's, or OpenVINO's and
    # ONNX Runtime's (host memory), do not, and the batch goes as it is.
    task.runner = SimpleNamespace(capabilities=Capabilities(stages=False))  # type: ignore[assignment]
    assert task.stage(batch, copy, compute) is batch
    assert not GraphRunner.capabilities.stages and not TorchRunner.capabilities.stages  # staged per device: __init__
    ids, mask, _ = task.collate(batch)
    event = object()
    staged = StagedBatch(batch, (ids + 100, mask, None), event, compute)
    got = task.collate(staged)
    assert compute.waited == [event]  # the forward pass's stream waits for the copy before reading it
    assert torch.equal(got[0], ids + 100) and got[1] is mask
    assert same_batch(staged, batch) and not same_batch(staged, batch[:1]) and not same_batch(batch, batch)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker dies on purpose
def test_when_a_staging_worker_dies_the_batch_it_had_staged_is_failed_not_lost(tmp_path: Path) -> None:
    from inferd.core.outcomes import Failure

    class Dying(StagingHandler):
        def infer(self, batch: list[Any]) -> list[str]:
            texts = super().infer(batch)  # held at the gate while the next batch is staged
            if texts[0].endswith("then die"):
                raise SystemExit("the worker dies with a batch staged")
            return texts

    handler = Dying()
    handler.gates["g"] = threading.Event()
    slot = ModelSlot(opened(handler, ModelSpec(tmp_path, "1")), ModelSpec(tmp_path, "1"), 0.0)
    queue = BatchQueue(claim=lambda b: b[0].slot.acquire())
    queue.add_lane("m", Policy(max_batch_size=1, max_wait_ms=0.0), 64)
    loop = asyncio.new_event_loop()
    try:
        with workers_on(queue, [Instance("m", 0, 1, live_lane("m"), FakeCudaStream(),
                                         copy_stream=FakeCudaStream())]) as outcomes:
            first = put(queue, loop, slot, "hold:g then die")
            wait_for(lambda: handler.batches, 10, every=0.002)
            staged = put(queue, loop, slot, "staged")
            wait_for(lambda: len(handler.staged) >= 2, 10, every=0.002)
            handler.gates["g"].set()
            wait_for(lambda: outcomes, 10, every=0.002)
    finally:
        loop.close()
    failed = [t for o in outcomes if isinstance(o, Failure) for t in o.tickets]
    assert handler.staged[1] == (["staged"], "hold:g then die")  # it was in the stager's hand when the worker died
    assert first in failed and staged in failed
    assert all(o.error.kind is Kind.WORKER_DEAD for o in outcomes if isinstance(o, Failure))
    assert slot.refs == 0  # the staged batch's claim on the model was let go with it: a retired model still frees


# -- alone on every thread ---------------------------------------------------------------------------------


class AloneHandler(HashHandler):
    """Records each batch's text, whether it ran alone (on every thread), and what else was inside at the time."""

    # As a model on an OpenVINO runner compiled for several instances.
    capabilities = Capabilities(can_use_all_threads=True)

    def __init__(self) -> None:
        super().__init__()
        self.alone: dict[str, bool] = {}
        self.beside: dict[str, set[str]] = {}
        self.inside: set[str] = set()
        self._lock = threading.Lock()

    def infer(self, batch: list[Any]) -> list[str]:
        text = decode_text(batch[0])
        with self._lock:
            self.alone[text] = running_alone()
            self.beside[text] = set(self.inside)
            for other in self.inside:
                self.beside[other].add(text)
            self.inside.add(text)
        try:
            return super().infer(batch)
        finally:
            with self._lock:
                self.inside.discard(text)


def two_sharing(model: str = "m") -> list[Instance]:
    sharing = Sharing()
    return [Instance(model, i, 1, live_lane(model), sharing=sharing) for i in range(2)]


@contextmanager
def held_model(tmp_path: Path) -> Iterator[tuple[AloneHandler, ModelSlot, BatchQueue, asyncio.AbstractEventLoop]]:
    """An AloneHandler whose ``hold:g`` texts wait for the test, its slot, a queue of batches of one, a loop."""
    handler = AloneHandler()
    handler.gates["g"] = threading.Event()
    queue = BatchQueue(claim=lambda b: b[0].slot.acquire())
    queue.add_lane("m", Policy(max_batch_size=1, max_wait_ms=0.0), 64)
    loop = asyncio.new_event_loop()
    try:
        yield handler, ModelSlot(opened(handler, ModelSpec(tmp_path, "1")), ModelSpec(tmp_path, "1"), 0.0), queue, loop
    finally:
        handler.gates["g"].set()
        loop.close()


def test_instances_run_side_by_side_on_their_share_while_work_waits_and_alone_on_every_thread_when_idle(
        tmp_path: Path) -> None:
    with held_model(tmp_path) as (handler, slot, queue, loop):
        put(queue, loop, slot, "hold:g a")
        put(queue, loop, slot, "hold:g b")  # both queued before either instance takes one: work waits
        with workers_on(queue, two_sharing()) as outcomes:
            wait_for(lambda: len(handler.batches) == 2, 10, every=0.002)
            both_inside = set(handler.inside)
            handler.gates["g"].set()
            wait_for(lambda: len(outcomes) == 2, 10, every=0.002)
            put(queue, loop, slot, "c")  # the model's only work, no sibling running
            wait_for(lambda: len(outcomes) == 3, 10, every=0.002)
    assert both_inside == {"hold:g a", "hold:g b"}  # two instances at once, each on its own share
    assert handler.alone == {"hold:g a": False, "hold:g b": False, "c": True}
    with all_threads():
        assert running_alone()
    assert not running_alone()  # only inside the context, on this thread


def test_a_sibling_waits_for_a_batch_running_alone_instead_of_oversubscribing_the_cores(tmp_path: Path) -> None:
    with held_model(tmp_path) as (handler, slot, queue, loop), workers_on(queue, two_sharing()) as outcomes:
        put(queue, loop, slot, "hold:g a")
        wait_for(lambda: handler.batches == [["hold:g a"]], 10, every=0.002)
        put(queue, loop, slot, "b")  # taken by the idle sibling, which must not start beside "a"
        wait_for(lambda: len(queue) == 0, 10, every=0.002)
        time.sleep(0.05)
        started_while_alone = [b for b in handler.batches]
        handler.gates["g"].set()
        wait_for(lambda: len(outcomes) == 2, 10, every=0.002)
    assert handler.alone["hold:g a"] is True
    assert started_while_alone == [["hold:g a"]]
    assert handler.beside == {"hold:g a": set(), "b": set()} and len(outcomes) == 2


def test_sharing_lets_one_alone_only_with_nothing_queued_and_no_sibling_running() -> None:
    sharing = Sharing()
    assert sharing.enter(lambda: False) is False  # work waits: on its own share
    assert sharing.enter(lambda: True) is False  # a sibling runs: on its own share
    sharing.leave(False)
    sharing.leave(False)
    assert sharing.enter(lambda: True) is True
    entered = threading.Event()
    got: list[bool] = []

    def sibling() -> None:
        got.append(sharing.enter(lambda: False))
        entered.set()

    t = threading.Thread(target=sibling, daemon=True)
    t.start()
    assert not entered.wait(0.05)  # waits while one runs alone
    sharing.leave(True)
    assert entered.wait(5) and got == [False]
    sharing.leave(False)
    t.join(5)


def test_a_job_s_pass_on_every_thread_keeps_live_batches_on_their_share_and_waits_for_one_alone() -> None:
    sharing = Sharing()
    sharing.enter_background()
    assert sharing.enter(lambda: True) is False  # the job's pass holds every thread: the live batch on its share
    sharing.leave(False)
    sharing.leave_background()
    assert sharing.enter(lambda: True) is True  # the pass done: alone again
    entered = threading.Event()

    def job() -> None:
        sharing.enter_background()
        entered.set()

    t = threading.Thread(target=job, daemon=True)
    t.start()
    assert not entered.wait(0.05)  # the job's next pass waits while a live batch has every thread
    sharing.leave(True)
    assert entered.wait(5)
    assert sharing.enter(lambda: True) is False
    sharing.leave(False)
    sharing.leave_background()
    t.join(5)


def test_an_openvino_model_of_several_instances_compiles_a_one_stream_twin_for_a_batch_run_alone(
        tmp_path: Path) -> None:
    import openvino as ov
    import openvino.opset13 as ops

    from inferd.core.backends.openvino import OpenVINORunner

    ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    ov.save_model(ov.Model([ops.convert(ops.multiply(ids, mask), ov.Type.f32)], [ids, mask]), tmp_path / "g.xml")
    feed = {"input_ids": np.full((2, 3), 5, np.int64), "attention_mask": np.ones((2, 3), np.int64)}
    one = OpenVINORunner(tmp_path / "g.xml", "hidden", "float32", "none", threads=2, streams=1)
    assert not one.capabilities.can_use_all_threads and one.info["threads_alone"] is None
    runner = OpenVINORunner(tmp_path / "g.xml", "hidden", "float32", "none", threads=2, streams=2)
    assert runner.capabilities.can_use_all_threads and runner.info["threads_alone"] == 2
    # Its own threads compute: the torch work around its pass keeps to one (core/instances.py apply_threads).
    assert not one.capabilities.torch_threads and not runner.capabilities.torch_threads
    wide = runner._wide  # noqa: SLF001
    assert int(wide.get_property("NUM_STREAMS")) == 1 and int(wide.get_property("INFERENCE_NUM_THREADS")) == 2
    shared = runner._run(feed)  # noqa: SLF001
    with all_threads():
        alone = runner._run(feed)  # noqa: SLF001
    assert shared.tolist() == alone.tolist() == [[5.0] * 3] * 2
    requests = runner._requests  # noqa: SLF001
    assert requests.alone.get_compiled_model() is not requests.request.get_compiled_model()
    runner.close()
    one.close()

