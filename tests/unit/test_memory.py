"""The memory guard (fake stats source), allocator settings, and out-of-memory handling in the engine."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from enginekit import EngineKit, until
from fakes import loader_for
from fastapi.testclient import TestClient
from settingskit import make_settings

from inferd.api.app import create_app
from inferd.core import memory
from inferd.core.description import Loaded, TaskFacts
from inferd.core.engine import InferenceEngine
from inferd.core.errors import EngineError, Kind
from inferd.core.memory import CudaStats, MemoryGuard, MemoryStats, ProcessStats, build_guard, configure_process
from inferd.core.preprocess import Encoded
from inferd.core.tasks.base import Handler
from inferd.utils.metrics import Metrics

MARKER = "BOOM"


# Every test's settings: the dev layers, on the CPU, loaded at start (make_settings(tmp_path, **SUITE, ...)).
# The OOM split is about batches of mixed texts: no padding floor splitting them first.
SUITE: dict[str, Any] = {"layered": "dev", "model": {"device": "cpu", "load_mode": "eager"},
                         "batching": {"min_padding_efficiency": 0.0}}


class FakeStats:
    """A stats source whose figures the test sets; empty_cache records when, and on which thread, it ran."""

    device = "cuda:0"

    def __init__(self, allocated: int, reserved: int, shrink: bool = True, events: list | None = None,
                 busy: Any = None) -> None:
        self.allocated, self.reserved, self.shrink = allocated, reserved, shrink
        self.events = events if events is not None else []
        self.busy = busy
        self.calls: list[str] = []

    def read(self) -> MemoryStats:
        return MemoryStats(self.allocated, self.reserved, self.allocated + 10, self.device)

    def empty_cache(self) -> None:
        self.calls.append(threading.current_thread().name)
        self.events.append(("empty_cache", self.busy.in_infer if self.busy else None))
        if self.shrink:
            self.reserved = self.allocated

    def summary(self) -> str:
        return "fake allocator summary"

    def utilization(self) -> float:
        return 0.25


class FakeHandler(Handler):
    """Embeds a text as [sum of its codes, its length]; runs out of memory on big batches or the marker."""

    def __init__(self, oom_over: int | None = None, events: list | None = None) -> None:
        self.oom_over = oom_over
        self.events = events if events is not None else []
        self.in_infer = False
        self.sizes: list[int] = []  # every batch tried
        self.served: list[int] = []  # the batches that fitted

    def load(self, spec: Any, device: torch.device) -> Loaded:
        return Loaded(facts=TaskFacts(dimension=2), max_seq_length=64, device="cpu", dtype="float32")

    def preprocess(self, texts: list[str]) -> list[Encoded]:
        return [Encoded([ord(c) for c in t], False) for t in texts]

    def infer(self, batch: list[Encoded]) -> np.ndarray:
        self.in_infer = True
        self.events.append(("infer", len(batch)))
        self.sizes.append(len(batch))
        try:
            marked = any(bytes(e.ids) == MARKER.encode() for e in batch)
            if marked or (self.oom_over is not None and len(batch) > self.oom_over):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            self.served.append(len(batch))
            return np.array([[sum(e.ids), len(e.ids)] for e in batch], dtype=np.float32)
        finally:
            self.in_infer = False

    def postprocess(self, outputs: np.ndarray) -> list[list[float]]:
        return [row.tolist() for row in outputs]

    def close(self) -> None:
        pass


def expected(text: str) -> list[float]:
    return [float(sum(map(ord, text))), float(len(text))]


# -- the guard -------------------------------------------------------------------------------------------


def guard_with(tmp_path: Path, source: Any, every: int = 1, threshold: float = 0.3) -> tuple[MemoryGuard, Metrics]:
    settings = make_settings(tmp_path, **SUITE, **{"memory.check_every_n": every,
                                                   "memory.fragmentation_threshold": threshold})
    guard = MemoryGuard(settings.memory, source)
    metrics = Metrics()
    guard.bind(metrics)
    return guard, metrics


def empties(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("inferd_empty_cache_total", {"reason": reason})


def test_guard_crosses_the_threshold_exactly_once_per_check(tmp_path: Path) -> None:
    source = FakeStats(allocated=600, reserved=1000)  # fragmentation 0.4 > 0.3
    guard, metrics = guard_with(tmp_path, source)
    assert guard.check() is True
    assert len(source.calls) == 1 and source.reserved == 600
    assert guard.check() is False  # the cache was returned: fragmentation 0 now
    assert len(source.calls) == 1
    source.reserved = 1000  # fragmented again
    assert guard.check() is True
    assert len(source.calls) == 2
    assert empties(metrics, "fragmentation") == 2 and guard.checks == 3


def test_a_check_empties_at_most_once_even_if_it_stays_fragmented(tmp_path: Path) -> None:
    source = FakeStats(allocated=100, reserved=1000, shrink=False)
    guard, metrics = guard_with(tmp_path, source)
    for n in range(1, 4):
        assert guard.check() is True
        assert len(source.calls) == n
    assert empties(metrics, "fragmentation") == 3


@pytest.mark.parametrize(("allocated", "reserved", "empties_cache"), [
    (700, 1000, False),  # exactly at the threshold: not above it
    (699, 1000, True),
    (0, 0, False),  # nothing reserved: no ratio to act on
])
def test_threshold_is_strict(tmp_path: Path, allocated: int, reserved: int, empties_cache: bool) -> None:
    source = FakeStats(allocated, reserved)
    guard, _ = guard_with(tmp_path, source)
    assert guard.check() is empties_cache
    assert len(source.calls) == int(empties_cache)


def test_tick_checks_every_n_requests(tmp_path: Path) -> None:
    source = FakeStats(allocated=100, reserved=1000, shrink=False)
    guard, _ = guard_with(tmp_path, source, every=5)
    assert [guard.tick(2), guard.tick(2)] == [False, False]
    assert guard.checks == 0
    assert guard.tick(1) is True  # 5 requests: one check
    assert guard.checks == 1 and len(source.calls) == 1
    assert guard.tick(12) is True  # a burst past n still makes one check, and the count restarts
    assert guard.checks == 2
    assert guard.tick(4) is False and guard.checks == 2


def test_report_has_the_figures_and_the_summary(tmp_path: Path) -> None:
    source = FakeStats(allocated=250, reserved=1000)
    guard, _ = guard_with(tmp_path, source, every=7, threshold=0.5)
    report = guard.report()
    assert report["device"] == "cuda:0"
    assert (report["allocated_bytes"], report["reserved_bytes"], report["peak_bytes"]) == (250, 1000, 260)
    assert report["fragmentation_ratio"] == 0.75
    assert report["utilization_ratio"] == 0.25
    assert report["summary"] == "fake allocator summary"
    assert (report["check_every_n"], report["fragmentation_threshold"]) == (7, 0.5)
    assert source.calls == []  # reporting never empties the cache


def test_process_stats_on_cpu_never_empty(tmp_path: Path) -> None:
    source = ProcessStats()
    stats = source.read()
    assert stats.device == "cpu" and stats.allocated > 10_000_000 and stats.peak >= stats.allocated
    assert stats.fragmentation == 0.0
    guard, metrics = guard_with(tmp_path, source, threshold=0.01)
    assert guard.check() is False
    assert source.utilization() is None and source.summary() is None


def test_utilization_failure_is_reported_once_then_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken(index: int) -> int:
        calls.append(index)
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(torch.cuda, "utilization", broken)
    source = CudaStats("cuda:1")
    assert source.index == 1 and source.device == "cuda:1"
    assert source.utilization() is None
    assert source.utilization() is None
    assert calls == [1]  # not retried on every scrape


# -- process settings ------------------------------------------------------------------------------------


def test_configure_process_sets_expandable_segments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.ALLOC_CONF, raising=False)
    guard = configure_process(make_settings(tmp_path, **SUITE))
    assert os.environ.get(memory.ALLOC_CONF) == "expandable_segments:True"
    assert isinstance(guard.source, ProcessStats)  # a CPU model: RSS stands in
    monkeypatch.setenv(memory.ALLOC_CONF, "max_split_size_mb:128")
    configure_process(make_settings(tmp_path, **SUITE))
    assert os.environ.get(memory.ALLOC_CONF) == "max_split_size_mb:128,expandable_segments:True"


def test_configure_process_leaves_the_allocator_alone_when_off(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.ALLOC_CONF, raising=False)
    configure_process(make_settings(tmp_path, **SUITE, **{"memory.expandable_segments": False}))
    assert os.environ.get(memory.ALLOC_CONF) is None


def test_per_process_fraction_applies_to_the_models_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    applied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: applied.append((f, d)))
    monkeypatch.setenv(memory.ALLOC_CONF, "expandable_segments:True")
    guard = configure_process(make_settings(tmp_path, **SUITE, **{"model.device": "cuda:1",
                                                                  "memory.per_process_fraction": 0.25}))
    assert isinstance(guard.source, CudaStats) and guard.source.device == "cuda:1"
    assert applied == [(0.25, 1)]


def test_build_guard_has_no_process_side_effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.ALLOC_CONF, raising=False)
    guard = build_guard(make_settings(tmp_path, **SUITE))
    assert isinstance(guard.source, ProcessStats)
    assert os.environ.get(memory.ALLOC_CONF) is None


# -- the engine: empty_cache between batches, out of memory split ---------------------------------------


def engine_with(tmp_path: Path, handler: FakeHandler, source: FakeStats, **overrides: Any) -> EngineKit:
    settings = make_settings(tmp_path, **SUITE, **overrides)
    return EngineKit(settings, handler, guard=MemoryGuard(settings.memory, source))


async def _all_in_one_batch(engine: InferenceEngine, texts: list[str]) -> list[Any]:
    """Submit one request per text while the queue is held, so they all meet in one batch."""
    engine.queue.pause(True)
    tasks = [asyncio.create_task(engine.process(engine.request([t]))) for t in texts]
    await until(lambda: len(engine.queue) >= len(texts))
    engine.queue.pause(False)
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_empty_cache_runs_on_the_worker_between_batches(tmp_path: Path) -> None:
    events: list[tuple[str, Any]] = []
    handler = FakeHandler(events=events)
    # Always fragmented and checked after every request: every batch boundary empties the cache.
    source = FakeStats(allocated=100, reserved=1000, shrink=False, events=events, busy=handler)
    kit = engine_with(tmp_path, handler, source, **{"memory.check_every_n": 1, "batching.max_batch_size": 3})
    engine = kit.engine

    async def scenario() -> None:
        for wave in range(3):
            results = await _all_in_one_batch(engine, [f"text {wave} {i}" for i in range(5)])
            assert all(not isinstance(r, BaseException) for r in results), results

    kit.run(scenario)
    assert engine.batches_run >= 6  # 5 texts per wave, at most 3 per batch
    assert source.calls and set(source.calls) == {"inferd-worker-all-MiniLM-L6-v2-0"}  # the model's one instance
    assert all(busy is False for kind, busy in events if kind == "empty_cache")
    # Each empty_cache follows a finished batch: never two batches' infer calls without one between them.
    kinds = [kind for kind, _ in events]
    assert kinds.count("infer") == engine.batches_run
    assert "infer,infer" not in ",".join(kinds)
    assert kinds.count("empty_cache") == engine.batches_run


def test_injected_oom_splits_and_every_other_request_succeeds(tmp_path: Path) -> None:
    handler = FakeHandler(oom_over=2)
    source = FakeStats(allocated=100, reserved=200)
    kit = engine_with(tmp_path, handler, source)
    engine = kit.engine
    texts = ["alpha", "bravo", "charlie", MARKER, "delta", "echo", "foxtrot", "golf"]

    async def scenario() -> tuple[list[Any], Any, bool]:
        results = await _all_in_one_batch(engine, texts)
        alive = engine.alive
        after = await engine.process(engine.request(["still serving"]))
        return results, after, alive

    results, after, alive = kit.run(scenario)
    for text, result in zip(texts, results, strict=True):
        if text == MARKER:
            assert isinstance(result, EngineError)
            assert result.kind is Kind.OOM
        else:
            assert not isinstance(result, BaseException), result
            assert result.outputs == [expected(text)]
    assert handler.sizes[0] == 8  # one batch first, then halves: 8 -> 4,4 -> 2,2,2,2 -> the marker's pair 1,1
    assert sorted(handler.sizes[:-1]) == sorted([8, 4, 4, 2, 2, 2, 2, 1, 1])  # the last: "still serving"
    m = engine.metrics.registry
    assert m.get_sample_value("inferd_oom_total") == 5
    assert m.get_sample_value("inferd_empty_cache_total", {"reason": "oom"}) == 5
    assert alive and engine.worker_error is None and engine.manager.state == "ready"
    assert after.outputs == [expected("still serving")]


def test_oom_over_http_is_507_and_the_service_stays_ready(tmp_path: Path) -> None:
    handler = FakeHandler(oom_over=4)
    settings = make_settings(tmp_path, **SUITE)
    guard = MemoryGuard(settings.memory, FakeStats(allocated=100, reserved=200))
    app = create_app(settings, loader=loader_for(handler), memory_guard=guard)
    with TestClient(app) as client:
        r = client.post("/predict", json={"texts": ["fine", MARKER]})
        assert r.status_code == 507, r.text
        assert set(r.json()["error"]) == {"message", "type", "code", "param"}
        assert r.json()["error"]["code"] == "out_of_memory"
        assert client.get("/health/ready").status_code == 200
        texts = [f"text number {i}" for i in range(9)]  # more than fits: split, all answered
        r = client.post("/predict", json={"texts": texts})
        assert r.status_code == 200, r.text
        assert r.json()["results"] == [expected(t) for t in texts]
        assert handler.sizes[-5:] == [9, 4, 5, 2, 3]  # 9 does not fit: halves until each part does
        assert handler.served[-3:] == [4, 2, 3]


# -- the C heap: trimmed on the worker, between batches (issue 8, item 10) ------------------------------------


class FakeHeap:
    """Records each trim: on which thread, and whether a forward pass was running at the time."""

    available = True

    def __init__(self, busy: Any = None, events: list | None = None) -> None:
        self.busy = busy
        self.events = events if events is not None else []
        self.threads: list[str] = []

    def trim(self) -> bool:
        self.threads.append(threading.current_thread().name)
        self.events.append(("trim", self.busy.in_infer if self.busy else None))
        return True


def test_tick_trims_the_heap_every_n_requests_and_never_when_off(tmp_path: Path) -> None:
    for every, ticks, trims in ((3, [1, 1, 1, 2, 1, 5], 3), (0, [1] * 50, 0), (1, [1] * 4, 4)):
        # No cost bound: these ticks come microseconds apart (the bound's own tests are below).
        settings = make_settings(tmp_path, **SUITE, **{"memory.malloc_trim_every_n": every,
                                                      "memory.malloc_trim_max_share": 0})
        heap = FakeHeap()
        guard = MemoryGuard(settings.memory, FakeStats(100, 100), heap=heap)  # type: ignore[arg-type]
        for n in ticks:
            guard.tick(n)
        assert len(heap.threads) == trims == guard.trims, (every, ticks)
        report = guard.report()
        assert report["malloc_trims"] == trims and report["malloc_trim_every_n"] == every
        assert report["malloc_trim_seconds"] >= 0


class SlowHeap:
    """A heap whose trim takes ``cost`` seconds of its own fake clock (``now``, the guard's clock)."""

    available = True

    def __init__(self, cost: float) -> None:
        self.t, self.cost, self.at = 0.0, cost, []

    def now(self) -> float:
        return self.t

    def trim(self) -> bool:
        self.at.append(self.t)
        self.t += self.cost
        return True


def test_costly_trims_are_spaced_to_their_share_of_the_worker(tmp_path: Path) -> None:
    # 400 requests a second, a trim due every 20, each taking 4 ms: unbounded, one per 54 ms (185 in 10 s). With a
    # 1 % share the next trim waits 0.4 s after one begins: ~25 in 10 s, never two within 0.4 s.
    for share, expected in ((0.01, range(24, 27)), (0.0, range(184, 187))):
        settings = make_settings(tmp_path, **SUITE, **{"memory.malloc_trim_every_n": 20,
                                                      "memory.malloc_trim_max_share": share})
        heap = SlowHeap(0.004)
        guard = MemoryGuard(settings.memory, FakeStats(100, 100), heap=heap,  # type: ignore[arg-type]
                            clock=heap.now)
        while heap.t < 10.0:
            guard.tick(1)
            heap.t += 1 / 400
        assert guard.trims == len(heap.at) and guard.trims in expected, (share, guard.trims)
        if share:
            gaps = [b - a for a, b in zip(heap.at, heap.at[1:], strict=False)]
            assert min(gaps) >= 0.4 - 1e-9 and guard.trim_seconds / heap.t <= share + 1e-9
        assert guard.report()["malloc_trim_max_share"] == share


def test_cheap_trims_keep_their_count(tmp_path: Path) -> None:
    # A trim of 0.1 ms at 5 requests a second (the soak's pace) is never held back: one per 20 requests.
    settings = make_settings(tmp_path, **SUITE, **{"memory.malloc_trim_every_n": 20})
    heap = SlowHeap(0.0001)
    guard = MemoryGuard(settings.memory, FakeStats(100, 100), heap=heap,  # type: ignore[arg-type]
                        clock=heap.now)
    for _ in range(400):
        guard.tick(1)
        heap.t += 0.2
    assert guard.trims == 20


def test_trims_run_on_the_worker_between_batches(tmp_path: Path) -> None:
    events: list[tuple[str, Any]] = []
    handler = FakeHandler(events=events)
    settings = make_settings(tmp_path, **SUITE, **{"memory.malloc_trim_every_n": 1, "batching.max_batch_size": 2})
    heap = FakeHeap(busy=handler, events=events)
    kit = EngineKit(settings, handler, guard=MemoryGuard(settings.memory, FakeStats(100, 100), heap=heap))
    engine = kit.engine

    async def scenario() -> None:
        results = await _all_in_one_batch(engine, [f"text {i}" for i in range(5)])
        assert all(not isinstance(r, BaseException) for r in results), results

    kit.run(scenario)
    assert heap.threads and set(heap.threads) == {"inferd-worker-all-MiniLM-L6-v2-0"}  # the model's one instance
    assert all(busy is False for kind, busy in events if kind == "trim")  # never during a forward pass


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@pytest.mark.skipif(not memory.NativeHeap().available, reason="needs glibc's malloc_trim (not musl or macOS)")
def test_native_heap_returns_freed_fragmented_memory_to_the_os() -> None:
    # The soak's pattern in miniature: blocks below glibc's mmap threshold, freed with survivors between them,
    # so the heap cannot shrink from its top. Without a trim the freed pages stay resident.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 96 * 1024, 2000  # about 190 MB
    blocks = [libc.malloc(size) for _ in range(count)]
    try:
        for b in blocks:
            ctypes.memset(b, 1, size)  # touch every page: resident
        for i, b in enumerate(blocks):
            if i % 16:
                libc.free(b)
        before = _rss()
        memory.NativeHeap().trim()
        released = before - _rss()
    finally:
        for i, b in enumerate(blocks):
            if not i % 16:
                libc.free(b)
    assert released > 100 * 2**20, f"malloc_trim released {released / 2**20:.1f} MiB of ~178 MiB freed"


def test_a_heap_that_cannot_trim_is_left_alone(tmp_path: Path) -> None:
    heap = memory.NativeHeap(find=False)  # as on musl or macOS: no malloc_trim
    assert not heap.available and heap.trim() is False
    settings = make_settings(tmp_path, **SUITE, **{"memory.malloc_trim_every_n": 1})
    guard = MemoryGuard(settings.memory, FakeStats(100, 100), heap=heap)
    guard.tick(5)
    assert guard.trims == 0


def test_the_heap_report_lists_allocation_sites_only_while_tracing() -> None:
    import tracemalloc

    assert not tracemalloc.is_tracing()
    assert memory.heap_top() is None
    tracemalloc.start()
    try:
        keep = [bytearray(1000) for _ in range(2000)]
        top = memory.heap_top(5)
    finally:
        tracemalloc.stop()
    assert top is not None and 1 <= len(top["top"]) <= 5 and top["traced_bytes"] >= 2_000_000
    assert "test_memory.py" in top["top"][0]["site"] and top["top"][0]["count"] >= 2000
    assert len(keep) == 2000


# A batch's tensors in miniature: big blocks of ever-different sizes, freed, while something small allocated
# between them lives on. Run in a child process: the threshold is process-wide.
FRAGMENT = """
import ctypes, ctypes.util, random, sys
import psutil
from inferd.core.memory import NativeHeap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "fixed":
    assert NativeHeap().set_mmap_threshold(131072)
first = libc.malloc(4 << 20)
ctypes.memset(first, 1, 4 << 20)
libc.free(first)  # with glibc's dynamic threshold, blocks up to 4 MB now come from the heap
rng = random.Random(1)
before = psutil.Process().memory_info().rss
keep = []
for _ in range(300):
    sizes = [rng.randrange(150_000, 3_000_000) for _ in range(4)]
    blocks = [libc.malloc(n) for n in sizes]
    for b, n in zip(blocks, sizes):
        ctypes.memset(b, 1, n)
    keep.append(libc.malloc(rng.randrange(64, 4096)))
    for b in blocks:
        libc.free(b)
print(psutil.Process().memory_info().rss - before)
"""


@pytest.mark.skipif(not memory.NativeHeap().available, reason="needs glibc's mallopt (not musl or macOS)")
def test_a_fixed_mmap_threshold_keeps_freed_tensors_out_of_the_resident_set() -> None:
    grown = {}
    for mode in ("dynamic", "fixed"):
        out = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        grown[mode] = int(out.stdout.strip())
    # The live data is ~0.6 MB of small blocks; the dynamic threshold keeps several times that resident.
    assert grown["fixed"] < 3 * 2**20, grown
    assert grown["dynamic"] > 4 * grown["fixed"], grown


class RecordingHeap(FakeHeap):
    def __init__(self, accept: bool = True) -> None:
        super().__init__()
        self.accept = accept
        self.thresholds: list[int] = []

    def set_mmap_threshold(self, size: int) -> bool:
        self.thresholds.append(size)
        return self.accept


@pytest.mark.parametrize(("configured", "accept", "expected"), [(131072, True, [131072]), (0, True, []),
                                                                (65536, False, [65536])])
def test_configure_process_fixes_the_mmap_threshold_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          configured: int, accept: bool, expected: list[int]) -> None:
    settings = make_settings(tmp_path, **SUITE, **{"memory.malloc_mmap_threshold": configured})
    heap = RecordingHeap(accept)
    guard = configure_process(settings, heap=heap)  # type: ignore[arg-type]
    assert heap.thresholds == expected
    assert guard.heap is heap  # the same heap is trimmed later
    assert ("was refused" in caplog.text) == (not accept)
