"""Memory discipline: allocator settings, figures from an injectable stats source, the fragmentation guard.

The guard runs on the inference worker thread between batches (never during one): every
``check_every_n`` requests it reads allocated/reserved memory and, when
(reserved - allocated) / reserved passes the threshold, returns cached blocks with ``empty_cache``.
The same source feeds ``/metrics`` (read at scrape time) and ``GET /admin/memory``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psutil
import torch

from inferd.settings import MemorySettings, Settings

log = logging.getLogger(__name__)

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True)
class MemoryStats:
    allocated: int
    reserved: int
    peak: int
    device: str

    @property
    def fragmentation(self) -> float:
        return (self.reserved - self.allocated) / self.reserved if self.reserved > 0 else 0.0


class StatsSource(Protocol):
    device: str

    def read(self) -> MemoryStats: ...
    def empty_cache(self) -> None: ...
    def summary(self) -> str | None: ...


class CudaStats:
    """torch.cuda's allocator figures for one device; utilisation from NVML (nvidia-ml-py)."""

    def __init__(self, device: int | str | None = None) -> None:
        # The index is resolved on first use: asking torch for the current device initialises CUDA, which
        # must not happen before configure_process has set the allocator's options.
        self._index = _cuda_index(device)
        self._nvml_ok = True

    @property
    def index(self) -> int:
        if self._index is None:
            self._index = torch.cuda.current_device()
        return self._index

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"

    def read(self) -> MemoryStats:
        i = self.index
        return MemoryStats(torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i),
                           torch.cuda.max_memory_allocated(i), self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def summary(self) -> str | None:
        return torch.cuda.memory_summary(self.index, abbreviated=True)

    def utilization(self) -> float | None:
        """Fraction of the last sample period a kernel ran (NVML); None when NVML cannot say."""
        if not self._nvml_ok:
            return None
        try:
            # torch maps its index onto NVML's (CUDA_VISIBLE_DEVICES) and calls pynvml.
            return torch.cuda.utilization(self.index) / 100.0
        except Exception as exc:  # no pynvml, no driver library, a MIG slice NVML will not report on
            self._nvml_ok = False
            log.warning("GPU utilisation unavailable (NVML): %s", exc)
            return None


class ProcessStats:
    """On the CPU the process's resident memory stands in; there is no cache to empty."""

    device = "cpu"

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._peak = 0

    def read(self) -> MemoryStats:
        rss = self._proc.memory_info().rss
        self._peak = max(self._peak, rss)
        return MemoryStats(rss, rss, self._peak, self.device)

    def empty_cache(self) -> None:
        return None

    def summary(self) -> str | None:
        return None

    def utilization(self) -> float | None:
        return None


class NativeHeap:
    """glibc's malloc, which holds torch's CPU tensors, the tokenizer's buffers and Python's large objects.

    Tensors of ever-different shapes (every batch has another length) fragment glibc's heaps: resident memory
    climbed 120-180 MB per 1,000 requests for as long as the service ran (bench/soak.py, bench/RESULTS.md).
    The cause is glibc's *dynamic* mmap threshold: once a large block served by mmap is freed, the threshold
    rises to its size (up to 32 MB), so later tensors come from the heap, where freed pages stay resident
    between blocks still in use. ``trim`` (the default remedy, every few batches) hands those pages back for
    ~1 % of CPU; a fixed threshold (``set_mmap_threshold``) keeps large tensors in their own mappings, returned
    whole on free, which holds RSS flatter but costs ~15 % more CPU (a page fault per page of every tensor).
    Neither exists where the C library is not glibc (musl, macOS): nothing is done there.
    """

    def __init__(self, libc: Any = None, *, find: bool = True) -> None:
        self._libc = libc if libc is not None else (_glibc() if find else None)

    @property
    def available(self) -> bool:
        return self._libc is not None

    def trim(self) -> bool:
        """Return free memory to the OS; True if any was."""
        return bool(self._libc.malloc_trim(0)) if self._libc is not None else False

    def set_mmap_threshold(self, size: int) -> bool:
        """Serve blocks of ``size`` bytes and more by mmap from now on, and stop glibc moving the threshold."""
        return bool(self._libc.mallopt(M_MMAP_THRESHOLD, size)) if self._libc is not None else False


M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc: no malloc_trim
        return None
    return libc


class MemoryGuard:
    """Reads the figures, empties the allocator's cache when fragmented, and counts what it did.

    ``tick`` and ``after_oom`` are called by the inference worker only, so ``empty_cache`` can never
    overlap a forward pass; ``read`` and ``report`` only read and may be called from any thread.
    """

    def __init__(self, settings: MemorySettings, source: StatsSource, metrics: Any = None,
                 heap: NativeHeap | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings
        self._clock = clock
        self.source = source
        self.metrics = metrics
        self.heap = heap if heap is not None else NativeHeap()
        self.empty_cache_calls = 0
        self.checks = 0
        self.last_check: dict[str, Any] | None = None
        self.trims = 0
        self.trim_seconds = 0.0
        self._since_check = 0
        self._since_trim = 0
        self._next_trim_at = 0.0  # by the clock: the cost bound's earliest next trim
        self._lock = threading.Lock()

    def bind(self, metrics: Any) -> None:
        """Count into these metrics, and let their scrape read this guard's figures."""
        self.metrics = metrics
        metrics.device.source = self

    def tick(self, requests: int) -> bool:
        """Count finished requests; every check_every_n, check fragmentation. True if it emptied the cache.

        Every ``malloc_trim_every_n`` requests it also trims the C heap (between batches, like the rest), but not
        before the last trim's cost allows, where ``malloc_trim_max_share`` is set: a trim that took d seconds is
        followed by the next one no sooner than d / share seconds after it began, so at any load the trims hold the
        worker at most that share of its time. At a few requests a second that bound never binds; at hundreds a
        second (a trim every 50 ms, 1.3-1.4 ms each on an OpenVINO server) it spaces them out,
        and resident memory grows between them (off by default: docs/memory.md has both figures).
        """
        every = self.settings.malloc_trim_every_n
        if every and self.heap.available:
            self._since_trim += requests
            if self._since_trim >= every and self._clock() >= self._next_trim_at:
                self._since_trim = 0
                self.trim()
        self._since_check += requests
        if self._since_check < self.settings.check_every_n:
            return False
        self._since_check = 0
        return self.check()

    def check(self) -> bool:
        """One look at the figures; at most one empty_cache, and only above the threshold."""
        with self._lock:
            stats = self.read()
            self.checks += 1
            self.last_check = {"fragmentation_ratio": round(stats.fragmentation, 6), "reserved_bytes": stats.reserved}
            if stats.reserved == 0 or stats.fragmentation <= self.settings.fragmentation_threshold:
                return False
            self._empty("fragmentation")
            after = self.read()
            log.info("memory fragmented: empty_cache called", extra={
                "fragmentation": round(stats.fragmentation, 4), "reserved_before": stats.reserved,
                "reserved_after": after.reserved, "allocated": stats.allocated})
            return True

    def trim(self) -> None:
        """Hand the C heap's free pages back to the OS (a few ms; the soak's totals are in RESULTS.md), count it."""
        started = self._clock()
        self.heap.trim()
        took = self._clock() - started
        self.trim_seconds += took
        self.trims += 1
        share = self.settings.malloc_trim_max_share
        self._next_trim_at = started + took / share if share else 0.0

    def after_oom(self) -> None:
        """After an out-of-memory error, give cached blocks back before the split halves run."""
        with self._lock:
            self._empty("oom")

    def _empty(self, reason: str) -> None:
        self.source.empty_cache()
        self.empty_cache_calls += 1
        if self.metrics is not None:
            self.metrics.empty_cache.labels(reason).inc()

    def read(self) -> MemoryStats:
        return self.source.read()

    def utilization(self) -> float | None:
        read = getattr(self.source, "utilization", None)
        return read() if read is not None else None

    def report(self) -> dict[str, Any]:
        stats = self.read()
        return {"device": stats.device, "allocated_bytes": stats.allocated, "reserved_bytes": stats.reserved,
                "peak_bytes": stats.peak, "fragmentation_ratio": round(stats.fragmentation, 6),
                "utilization_ratio": self.utilization(),
                "fragmentation_threshold": self.settings.fragmentation_threshold,
                "check_every_n": self.settings.check_every_n, "checks": self.checks,
                "last_check": self.last_check, "empty_cache_calls": self.empty_cache_calls,
                "malloc_trim_every_n": self.settings.malloc_trim_every_n,
                "malloc_trim_max_share": self.settings.malloc_trim_max_share, "malloc_trims": self.trims,
                "malloc_trim_seconds": round(self.trim_seconds, 6),
                "alloc_conf": os.environ.get(ALLOC_CONF), "summary": self.source.summary(),
                "heap": heap_top()}


_settle_lock = threading.Lock()


def settle_heap() -> float:
    """After a model loads: collect what loading left behind, then move every live object out of the collector's
    reach (``gc.freeze``); returns the seconds it took.

    With torch, transformers and a model loaded the heap holds some 260,000 tracked objects, and the collector's
    oldest generation walks them all: while serving, a full collection came every 6-8 s and held the GIL (the
    event loop and the workers) for ~0.22 s each, 0.3 ms of CPU a request at 150 requests/s (bench/RESULTS.md,
    "The collector"). Frozen, they are never walked again; what requests allocate is still collected.
    Earlier loads' objects are thawed first, so the cycles of a model freed since (its weights went with
    reference counting at once) are collected here, at the next load, not kept for ever.
    """
    started = time.perf_counter()
    with _settle_lock:  # models load on several threads; one settles at a time
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    return time.perf_counter() - started


def heap_top(limit: int = 10) -> dict[str, Any] | None:
    """The Python heap by allocation site, when tracemalloc traces (PYTHONTRACEMALLOC=1); else None."""
    if not tracemalloc.is_tracing():
        return None
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    traced, peak = tracemalloc.get_traced_memory()
    top = snapshot.statistics("lineno")[:limit]
    return {"traced_bytes": traced, "peak_bytes": peak,
            "top": [{"site": str(s.traceback[0]), "size_bytes": s.size, "count": s.count} for s in top]}


def _cuda_index(device: int | str | None) -> int | None:
    if isinstance(device, int) or device is None:
        return device
    _, _, index = device.partition(":")
    return int(index) if index else None


def device_memory(device: str) -> tuple[int, int] | None:
    """(bytes allocated by tensors, the device's total) on the CUDA device a model setting names (auto: the
    current one when CUDA is present); None on a CPU. A model's ``memory_fraction`` is checked against it."""
    if not (device.startswith("cuda") or device == "auto") or not torch.cuda.is_available():
        return None
    index = _cuda_index(device if device != "auto" else None)
    index = torch.cuda.current_device() if index is None else index
    return int(torch.cuda.memory_allocated(index)), int(torch.cuda.get_device_properties(index).total_memory)


def _wants_cuda(settings: Settings) -> bool:
    device = settings.model.device
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def build_guard(settings: Settings) -> MemoryGuard:
    """The guard for the configured device, with no process-wide side effects (create_app's default)."""
    if _wants_cuda(settings) and torch.cuda.is_available():
        return MemoryGuard(settings.memory, CudaStats(settings.model.device))
    return MemoryGuard(settings.memory, ProcessStats())


def configure_process(settings: Settings, heap: NativeHeap | None = None) -> MemoryGuard:
    """Process-wide settings that must precede CUDA's initialisation (and the model's first tensors);
    returns the guard for the device."""
    mem = settings.memory
    heap = heap if heap is not None else NativeHeap()
    # mallopt at run time rather than MALLOC_MMAP_THRESHOLD_ in the environment (read once, at malloc's start):
    # no re-exec, and the same for `inferd serve`, an app embedding inferd, and the tests.
    if mem.malloc_mmap_threshold and heap.available and not heap.set_mmap_threshold(mem.malloc_mmap_threshold):
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused; glibc keeps its dynamic threshold",
                    mem.malloc_mmap_threshold)
    if mem.expandable_segments:
        conf = os.environ.get(ALLOC_CONF, "")
        if "expandable_segments" not in conf:
            # Keep whatever else the operator set; only add ours.
            os.environ[ALLOC_CONF] = ",".join(p for p in (conf, "expandable_segments:True") if p)
        if torch.cuda.is_initialized():
            log.warning("CUDA was initialised before configure_process; expandable_segments may not apply")
    if settings.runtime.torch_threads:
        torch.set_num_threads(settings.runtime.torch_threads)
    torch.manual_seed(settings.runtime.seed)
    guard = build_guard(settings)
    guard.heap = heap
    if isinstance(guard.source, CudaStats) and mem.per_process_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(mem.per_process_fraction, guard.source.index)
    return guard
