"""Live first (core/background.py): a model's background items (batch jobs' lines) run on a background worker of
their own, whose pass stops before each pause point while a live batch runs, so a live request never waits for a
whole background batch."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import wait_for
from enginekit import EngineKit, ask, until
from fakes import HashHandler, decode, encode, vector_for
from settingskit import make_settings
from transformers import BertConfig, BertModel

from inferd.core.backends.base import GraphRunner, running_alone
from inferd.core.backends.torch import TorchRunner
from inferd.core.backends.varlen import VarlenRunner
from inferd.core.background import LiveFirst
from inferd.core.batcher import BatchQueue
from inferd.core.capabilities import Capabilities
from inferd.core.outcomes import Ticket, WorkItem
from inferd.core.scheduler import BACKGROUND, Policy
from inferd.settings import BatchingSettings

CPU = torch.device("cpu")


class Counted(torch.nn.Module):
    """A pause point that counts the passes through it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + 1


def background_pass(first: LiveFirst, model: torch.nn.Module, points: list[torch.nn.Module],
                    done: list[Any]) -> threading.Thread:
    def run() -> None:
        with first.background(points) as paused:
            model(torch.zeros(2))
        done.append(paused)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_background_pass_stops_at_its_next_pause_point_while_a_live_batch_runs() -> None:
    first = LiveFirst()
    model = torch.nn.Sequential(Counted(), Counted(), Counted())
    done: list[Any] = []
    with first.live():
        thread = background_pass(first, model, list(model), done)
        wait_for(lambda: first._waiting == 1, what="the background pass stopped")
        assert [m.calls for m in model] == [0, 0, 0] and not done  # stopped before its first point
        # A live pass through the same modules, on another thread, is not stopped by the background pass's hooks.
        assert torch.equal(model(torch.zeros(2)), torch.full((2,), 3.0))
    thread.join(10)
    [paused] = done
    assert paused.times == 1 and paused.seconds > 0
    assert [m.calls for m in model] == [2, 2, 2]
    assert all(not m._forward_pre_hooks for m in model)  # the hooks were the pass's only


def test_a_background_pass_with_no_live_batch_beside_it_never_stops() -> None:
    first = LiveFirst()
    model = torch.nn.Sequential(Counted(), Counted())
    done: list[Any] = []
    background_pass(first, model, list(model), done).join(10)
    [paused] = done
    assert paused.times == 0 and paused.seconds == 0.0 and [m.calls for m in model] == [1, 1]


def test_closing_lets_a_stopped_background_pass_finish() -> None:
    first = LiveFirst()
    model = torch.nn.Sequential(Counted())
    done: list[Any] = []
    with first.live():
        thread = background_pass(first, model, list(model), done)
        wait_for(lambda: first._waiting == 1, what="the background pass stopped")
        first.close()  # the server stops while a live batch still runs
        thread.join(10)
        assert done and model[0].calls == 1


class Threads(torch.nn.Module):
    """A pause point that records the intra-op thread count its pass runs at, after waiting for ``go`` if given."""

    def __init__(self, go: threading.Event | None = None, reached: threading.Event | None = None) -> None:
        super().__init__()
        self.go, self.reached, self.seen = go, reached, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        if self.reached is not None:
            self.reached.set()
        if self.go is not None:
            assert self.go.wait(10)
        return x + 1


def test_a_sharing_background_pass_narrows_beside_live_batches_and_widens_after() -> None:
    first = LiveFirst()
    in_first, go_on, in_third, finish = (threading.Event() for _ in range(4))
    model = torch.nn.Sequential(Threads(go_on, in_first), Threads(), Threads(finish, in_third), Threads())
    done: list[Any] = []

    def run() -> None:
        torch.set_num_threads(4)
        with first.background(list(model), share=True) as paused:
            model(torch.zeros(2))
        done.append((paused, torch.get_num_threads()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert in_first.wait(10)  # the pass computes: a live batch now starts on half its threads
    own = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with first.live(narrowable=False):  # a burst keeps every thread
            assert torch.get_num_threads() == 4 and first._live_wide == 1
        with first.live():
            assert torch.get_num_threads() == 2 and first._live_wide == 0
            go_on.set()
            assert in_third.wait(10)  # went on past the second point, narrowed, without stopping
        assert torch.get_num_threads() == 4  # the live thread's own count again
        finish.set()
        thread.join(10)
    finally:
        torch.set_num_threads(own)
    [(paused, after)] = done
    assert [m.seen for m in model] == [[4], [2], [2], [4]]  # narrowed at the first point with live work, widened
    assert paused.times == 0 and after == 4


def test_a_sharing_background_pass_still_stops_for_a_live_batch_on_all_its_threads() -> None:
    first = LiveFirst()
    model = torch.nn.Sequential(Counted(), Counted())
    done: list[Any] = []

    def run() -> None:
        with first.background(list(model), share=True) as paused:
            model(torch.zeros(2))
        done.append(paused)

    with first.live():  # started before the pass: it has every thread, so the pass waits for it
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wait_for(lambda: first._waiting == 1, what="the background pass stopped")
        assert [m.calls for m in model] == [0, 0] and first._sharing == 0
    thread.join(10)
    [paused] = done
    assert paused.times == 1 and [m.calls for m in model] == [1, 1] and first._sharing == 0


def test_torch_runners_pause_before_each_linear_layer_on_a_cpu_and_graphs_never() -> None:
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    for runner_type in (TorchRunner, VarlenRunner):
        runner = runner_type(BertModel(config, add_pooling_layer=False), CPU)
        assert runner.capabilities.pauses
        points = runner.pause_points()
        assert len(points) == 2 * 6 and all(isinstance(p, torch.nn.Linear) for p in points)
        # Every point is one the pass calls: a pass under background() with no live batch stops at none and
        # passes through all of them.
        seen: list[torch.nn.Module] = []

        def note(module: torch.nn.Module, args: Any, seen: list[torch.nn.Module] = seen) -> None:
            seen.append(module)

        handles = [p.register_forward_pre_hook(note) for p in points]
        runner(torch.ones(2, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
        for h in handles:
            h.remove()
        assert {id(m) for m in seen} == {id(p) for p in points}
        runner.close()
        assert runner.pause_points() == []
    assert GraphRunner.pause_points(object.__new__(GraphRunner)) == []


def _item(loop: asyncio.AbstractEventLoop, slot: Any, queue: BatchQueue, priority: int, text: str) -> WorkItem:
    now = time.monotonic()
    return WorkItem(Ticket(loop.create_future(), 1), 0, encode(text), 4, priority, now, now + 60, queue.next_seq(),
                    slot)


Lane = tuple[asyncio.AbstractEventLoop, Any, BatchQueue]


@pytest.fixture
def lane() -> Iterator[Lane]:
    """A loop for the items' futures, a fake slot and a queue of one lane "m" that never waits for companions."""
    loop = asyncio.new_event_loop()
    queue = BatchQueue()
    queue.add_lane("m", Policy(max_wait_ms=0.0), 64)
    try:
        yield loop, type("Slot", (), {"capabilities": HashHandler.capabilities})(), queue
    finally:
        loop.close()


def test_the_queue_says_whether_a_live_item_waits_beside_background_ones(lane: Lane) -> None:
    loop, slot, queue = lane
    assert not queue.live_waiting("m") and not queue.live_waiting("unknown")
    queue.put([_item(loop, slot, queue, BACKGROUND, f"line {i}") for i in range(3)], "m")
    assert queue.depth("m") == 3 and not queue.live_waiting("m")  # a job's lines are no burst
    queue.put([_item(loop, slot, queue, 0, "live")], "m")
    assert queue.live_waiting("m")


def test_a_taker_that_no_longer_takes_background_items_passes_their_wake_on(lane: Lane) -> None:
    # A settings reload turns background_pauses back on: a live instance that took both kinds takes live ones only,
    # and the model's new background worker waits too. A background item put while the live instance's wake (the
    # reload's) is pending must still reach the background worker.
    loop, slot, queue = lane
    kinds: dict[str, bool | None] = {"live": None}
    got: list[str] = []

    def live() -> None:
        queue.take(timeout=10, background=lambda: kinds["live"])

    def background() -> None:
        handout = queue.take(timeout=10, background=True)
        if handout is not None:
            got.extend(decode(it.encoded) for it in handout.batch)

    first, second = threading.Thread(target=live), threading.Thread(target=background)
    first.start()
    second.start()
    wait_for(lambda: len(queue._idle) == 2, what="both takers waiting")
    with queue._cond:  # the reload and the put, before the live instance looks again
        kinds["live"] = False
        # The reload's wake reached the live instance only (the new background worker began waiting after it).
        woken = next(t for t in queue._idle if t.background is None)
        woken.woken = True
        woken.cond.notify()
        queue.put([_item(loop, slot, queue, BACKGROUND, "job")], "m")
    second.join(2)  # at once, not at either taker's timeout
    assert got == ["job"]
    queue.close()
    first.join(10)


def test_the_queue_hands_background_items_to_background_takers_and_live_ones_to_live_takers(lane: Lane) -> None:
    loop, slot, queue = lane
    got: dict[str, list[str]] = {"live": [], "background": []}

    def taker(name: str, background: bool) -> None:
        handout = queue.take(timeout=10, background=background)
        if handout is not None:
            got[name] += [decode(it.encoded) for it in handout.batch]

    threads = [threading.Thread(target=taker, args=("background", True)),
               threading.Thread(target=taker, args=("live", False))]
    for t in threads:
        t.start()
    wait_for(lambda: len(queue._idle) == 2, what="both takers waiting")
    # A live item wakes the live taker although the background one waits too (and was first to wait).
    queue.put([_item(loop, slot, queue, 0, "live")], "m")
    threads[1].join(10)
    assert got["live"] == ["live"] and threads[0].is_alive()
    queue.put([_item(loop, slot, queue, BACKGROUND, "job")], "m")
    threads[0].join(10)
    assert got["background"] == ["job"]
    # A worker's death drains only the kind it took.
    queue.put([_item(loop, slot, queue, 0, "a")], "m")
    queue.put([_item(loop, slot, queue, BACKGROUND, "b")], "m")
    assert [decode(it.encoded) for it in queue.drain_all(background=True)] == ["b"]
    assert queue.depth("m") == 1


class PausingHandler(HashHandler):
    """A fake whose pass goes through one pause point, and records the thread each batch ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.point = Counted()
        self.threads: dict[str, str] = {}

    def pause_points(self) -> list[Any]:
        return [self.point]

    def infer(self, batch: list[Any]) -> list[str]:
        texts = super().infer(batch)
        for text in texts:
            self.threads[text] = threading.current_thread().name
        self.point(torch.zeros(1))
        return texts


def test_a_live_request_is_answered_while_a_background_batch_waits_at_its_pause_point(tmp_path: Path) -> None:
    handler = PausingHandler()
    settings = make_settings(tmp_path, batching=BatchingSettings(max_wait_ms=0.0, max_batch_size=8, max_queue=64))
    kit = EngineKit(settings, handler)
    engine = kit.engine
    first = engine.worker.live_first

    async def scenario() -> None:
        handler.gates["l"] = threading.Event()
        live = ask(engine, ["hold:l"])
        await until(lambda: first._live == 1, what="the live batch running")
        job = ask(engine, ["line"], priority=BACKGROUND)
        await until(lambda: first._waiting == 1, what="the background batch stopped at its pause point")
        assert handler.threads["line"].endswith("-background") and not job.done()
        # Another live request is answered while the job's batch waits, on a live instance.
        handler.gates["l"].set()
        assert (await live).outputs == [vector_for("hold:l")]
        assert (await job).outputs == [vector_for("line")]
        assert (await ask(engine, ["after"])).outputs == [vector_for("after")]
        assert handler.threads["after"].endswith("-0") and handler.threads["hold:l"].endswith("-0")

    kit.run(scenario)


class CountingThreads(PausingHandler):
    """Records the intra-op thread count each text's pass ran at."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def infer(self, batch: list[Any]) -> list[str]:
        texts = super().infer(batch)
        for text in texts:
            self.counts[text] = torch.get_num_threads()
        return texts


def test_with_shared_cores_a_lone_live_request_runs_narrow_beside_a_background_pass(tmp_path: Path) -> None:
    handler = CountingThreads()
    settings = make_settings(tmp_path, batching=BatchingSettings(max_wait_ms=0.0, max_batch_size=8, max_queue=64,
                                                                 background_shares_cores=True))
    kit = EngineKit(settings, handler)
    engine = kit.engine
    first = engine.worker.live_first

    async def scenario() -> None:
        handler.gates["j"] = threading.Event()
        job = ask(engine, ["hold:j"], priority=BACKGROUND)
        await until(lambda: first.sharing_now, what="the background pass computing, sharing")
        # A lone live request is answered while the job's pass still computes: nothing stopped, it ran narrow.
        assert (await ask(engine, ["lone"])).outputs == [vector_for("lone")]
        assert not job.done() and first._waiting == 0
        handler.gates["j"].set()
        assert (await job).outputs == [vector_for("hold:j")]
        assert (await ask(engine, ["after"])).outputs == [vector_for("after")]  # no job: every thread
        assert handler.counts["lone"] == max(1, handler.counts["after"] // 2)
        assert handler.threads["lone"].endswith("-0") and handler.threads["hold:j"].endswith("-background")

    kit.run(scenario)


def test_background_requests_run_on_the_model_s_background_worker_and_live_ones_never_do(tmp_path: Path) -> None:
    handler = PausingHandler()
    kit = EngineKit(make_settings(tmp_path), handler)
    engine = kit.engine

    async def scenario() -> None:
        assert (await ask(engine, ["y"], priority=BACKGROUND)).outputs == [vector_for("y")]
        assert (await ask(engine, ["x"], priority=-99)).outputs == [vector_for("x")]
        assert handler.threads["y"].endswith("-background") and handler.threads["x"].endswith("-0")
        assert handler.point.calls == 2

    kit.run(scenario)


def test_with_background_pauses_off_the_model_s_instances_take_background_items_too(tmp_path: Path) -> None:
    handler = PausingHandler()
    settings = make_settings(tmp_path, batching=BatchingSettings(background_pauses=False))
    kit = EngineKit(settings, handler)
    engine = kit.engine

    async def scenario() -> None:
        assert (await ask(engine, ["y"], priority=BACKGROUND)).outputs == [vector_for("y")]
        assert handler.threads["y"].endswith("-0") and not engine.worker._background

    kit.run(scenario)


def test_a_settings_reload_turning_background_pauses_off_retires_the_background_worker(tmp_path: Path) -> None:
    handler = PausingHandler()
    kit = EngineKit(make_settings(tmp_path), handler)
    engine = kit.engine

    async def scenario() -> None:
        assert (await ask(engine, ["before"], priority=BACKGROUND)).outputs == [vector_for("before")]
        [served] = list(engine.registry)
        entry = served.entry
        off = entry.model_copy(update={"batching": entry.batching.model_copy(update={"background_pauses": False})})
        [retired] = engine.worker._background.values()
        engine.worker.set_model(off)
        await until(lambda: not retired.thread.is_alive(), what="the background worker gone")
        # The live instance, waiting in the queue for live work only, now takes background items as well.
        assert (await ask(engine, ["after"], priority=BACKGROUND)).outputs == [vector_for("after")]
        assert handler.threads["before"].endswith("-background") and handler.threads["after"].endswith("-0")
        assert not engine.worker._background
        engine.worker.set_model(entry)  # and back on: a background worker again
        assert (await ask(engine, ["again"], priority=BACKGROUND)).outputs == [vector_for("again")]
        assert handler.threads["again"].endswith("-background")

    kit.run(scenario)


class WideningHandler(HashHandler):
    """A fake whose runner can run a batch on every thread of the model (an OpenVINO graph of several instances), and
    records whether each text's batch was allowed to."""

    capabilities = Capabilities(can_use_all_threads=True)

    def __init__(self) -> None:
        super().__init__()
        self.alone: dict[str, bool] = {}

    def infer(self, batch: list[Any]) -> list[str]:
        for encoded in batch:  # before the pass, which a held text blocks
            self.alone[decode(encoded)] = running_alone()
        return super().infer(batch)


def test_a_background_batch_runs_on_every_thread_beside_live_requests_too(tmp_path: Path) -> None:
    handler = WideningHandler()
    settings = make_settings(tmp_path, batching=BatchingSettings(background_quiet_s=60.0))
    kit = EngineKit(settings, handler)
    engine = kit.engine

    async def scenario() -> None:
        assert (await ask(engine, ["first line"], priority=BACKGROUND)).outputs == [vector_for("first line")]
        # A live request just came (and the quiet spell is a minute): the job's next batch still has every thread.
        assert (await ask(engine, ["live"])).outputs == [vector_for("live")]
        assert (await ask(engine, ["line after live"], priority=BACKGROUND)).outputs == [vector_for("line after live")]
        assert handler.alone == {"first line": True, "live": False, "line after live": True}

    kit.run(scenario)


def test_a_live_batch_beside_a_job_s_pass_on_every_thread_runs_on_its_own_stream(tmp_path: Path) -> None:
    handler = WideningHandler()
    settings = make_settings(tmp_path, model={"instances": 2, "threads": 1},
                             batching=BatchingSettings(max_wait_ms=0.0, max_batch_size=8, max_queue=64))
    kit = EngineKit(settings, handler)
    engine = kit.engine

    async def scenario() -> None:
        # No job: a lone live request is its model's only work and has every thread.
        assert (await ask(engine, ["alone"])).outputs == [vector_for("alone")]
        handler.gates["j"] = threading.Event()
        job = ask(engine, ["hold:j"], priority=BACKGROUND)
        await until(lambda: "hold:j" in handler.alone, what="the job's pass computing")
        # Beside the job's pass on every thread the lone live request keeps to one instance's stream.
        assert (await ask(engine, ["beside"])).outputs == [vector_for("beside")]
        # The job's lines still queued are no burst: once its pass is done, a lone live request has every thread.
        later = ask(engine, [f"queued {i}" for i in range(3)], priority=BACKGROUND)
        handler.gates["j"].set()
        assert (await job).outputs == [vector_for("hold:j")]
        await later
        assert (await ask(engine, ["after"])).outputs == [vector_for("after")]
        assert {k: handler.alone[k] for k in ("alone", "hold:j", "beside", "after")} == {
            "alone": True, "hold:j": True, "beside": False, "after": True}

    kit.run(scenario)


def test_a_background_batch_of_a_runner_that_cannot_widen_stays_on_its_threads(tmp_path: Path) -> None:
    handler = WideningHandler()
    handler.capabilities = Capabilities(can_use_all_threads=False)
    kit = EngineKit(make_settings(tmp_path), handler)

    async def scenario() -> None:
        assert (await ask(kit.engine, ["line"], priority=BACKGROUND)).outputs == [vector_for("line")]
        assert handler.alone == {"line": False}

    kit.run(scenario)


class NiceHandler(HashHandler):
    """A fake that records the OS priority (nice) of the thread each text's batch ran on, with or without pause
    points."""

    def __init__(self, pauses: bool) -> None:
        super().__init__()
        self.pauses = pauses
        self.point = Counted()
        self.nice: dict[str, int] = {}

    def pause_points(self) -> list[Any]:
        return [self.point] if self.pauses else []

    def infer(self, batch: list[Any]) -> list[str]:
        texts = super().infer(batch)
        for text in texts:
            self.nice[text] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return texts


@pytest.mark.parametrize(("pauses", "setting", "expected"), [(False, 19, 19), (False, 0, 0), (True, 19, 0)])
def test_a_background_pass_that_cannot_pause_runs_niced_and_live_passes_never_do(
        tmp_path: Path, pauses: bool, setting: int, expected: int) -> None:
    handler = NiceHandler(pauses)
    kit = EngineKit(make_settings(tmp_path, batching=BatchingSettings(background_nice=setting)), handler)

    async def scenario() -> None:
        assert (await ask(kit.engine, ["line"], priority=BACKGROUND)).outputs == [vector_for("line")]
        assert (await ask(kit.engine, ["live"])).outputs == [vector_for("live")]
        assert handler.nice == {"line": expected, "live": 0}

    kit.run(scenario)


def test_a_niced_background_thread_goes_back_for_torch_passes_or_says_why_it_cannot(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Lowering a nice value needs a privilege a container's user lacks: the thread then keeps it, says so once,
    and runs on (its torch passes still stop at their pause points)."""
    first = LiveFirst()
    seen: list[int] = []

    def passes(refuse: bool) -> None:
        real = os.setpriority

        def setpriority(which: int, who: int, value: int) -> None:
            if refuse and value < os.getpriority(which, who):
                raise PermissionError(1, "Operation not permitted")
            real(which, who, value)

        monkeypatch.setattr(os, "setpriority", setpriority)
        for points in ([], [Counted()], [Counted()]):
            with first.background(points, nice=19):
                seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    for refuse in (False, True):
        thread = threading.Thread(target=passes, args=(refuse,))
        thread.start()
        thread.join()
    assert seen == [19, 0, 0, 19, 19, 19]
    refusals = [r for r in caplog.records if "stays at nice 19" in r.getMessage()]
    assert len(refusals) == 1 and "CAP_SYS_NICE" in refusals[0].getMessage()
