"""Memory discipline: allocator settings, figures from an injectable stats source, the fragmentation guard.

The guard runs on the inference worker thread between batches (never during one): every
``check_every_n`` requests it reads allocated/reserved memory and, when
(reserved - allocated) / reserved passes the threshold, returns cached blocks with ``empty_cache``.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import psutil
import torch

from inferd.config import MemorySettings, Settings

log = logging.getLogger(__name__)


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
    def __init__(self, device: int | None = None) -> None:
        self.index = torch.cuda.current_device() if device is None else device
        self.device = f"cuda:{self.index}"

    def read(self) -> MemoryStats:
        return MemoryStats(torch.cuda.memory_allocated(self.index), torch.cuda.memory_reserved(self.index),
                           torch.cuda.max_memory_allocated(self.index), self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def summary(self) -> str | None:
        return torch.cuda.memory_summary(self.index, abbreviated=True)


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


class MemoryGuard:
    def __init__(self, settings: MemorySettings, source: StatsSource, metrics: Any = None) -> None:
        self.settings = settings
        self.source = source
        self.metrics = metrics
        self.empty_cache_calls = 0
        self.checks = 0
        self._since_check = 0
        self._lock = threading.Lock()

    def tick(self, requests: int) -> bool:
        """Count finished requests; every check_every_n, check fragmentation. True if it emptied the cache."""
        self._since_check += requests
        if self._since_check < self.settings.check_every_n:
            return False
        self._since_check = 0
        return self.check()

    def check(self) -> bool:
        with self._lock:
            stats = self.read()
            self.checks += 1
            if stats.reserved == 0 or stats.fragmentation <= self.settings.fragmentation_threshold:
                return False
            self.source.empty_cache()
            self.empty_cache_calls += 1
            if self.metrics is not None:
                self.metrics.empty_cache.inc()
            after = self.read()
            log.info("memory fragmented: empty_cache called", extra={
                "fragmentation": round(stats.fragmentation, 4), "reserved_before": stats.reserved,
                "reserved_after": after.reserved, "allocated": stats.allocated})
            return True

    def after_oom(self) -> None:
        """After an out-of-memory error, give cached blocks back before the split halves run."""
        self.source.empty_cache()

    def read(self) -> MemoryStats:
        stats = self.source.read()
        if self.metrics is not None:
            self.metrics.gpu_allocated.set(stats.allocated)
            self.metrics.gpu_reserved.set(stats.reserved)
            self.metrics.gpu_peak.set(stats.peak)
            self.metrics.gpu_fragmentation.set(stats.fragmentation)
        return stats

    def report(self) -> dict[str, Any]:
        stats = self.read()
        return {"device": stats.device, "allocated_bytes": stats.allocated, "reserved_bytes": stats.reserved,
                "peak_bytes": stats.peak, "fragmentation_ratio": round(stats.fragmentation, 6),
                "fragmentation_threshold": self.settings.fragmentation_threshold,
                "check_every_n": self.settings.check_every_n, "checks": self.checks,
                "empty_cache_calls": self.empty_cache_calls, "summary": self.source.summary()}


def configure_process(settings: Settings) -> MemoryGuard:
    """Process-wide settings that must precede CUDA's initialisation; returns the guard for the device."""
    mem = settings.memory
    if mem.expandable_segments and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if settings.runtime.torch_threads:
        torch.set_num_threads(settings.runtime.torch_threads)
    torch.manual_seed(settings.runtime.seed)
    wants_cuda = settings.model.device.startswith("cuda") or (
        settings.model.device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        if mem.per_process_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(mem.per_process_fraction)
        return MemoryGuard(mem, CudaStats())
    return MemoryGuard(mem, ProcessStats())
