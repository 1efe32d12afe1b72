"""Metrics: names and buckets, and device figures read at scrape time from the memory guard's source."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from settingskit import make_settings

from inferd.core.memory import MemoryGuard, MemoryStats, ProcessStats
from inferd.utils.metrics import GPU_METRICS, LATENCY_BUCKETS, REJECT_REASONS, Metrics, batch_size_buckets


class SettableStats:
    device = "cuda:0"

    def __init__(self, allocated: int, reserved: int, peak: int, utilization: float | None = 0.5) -> None:
        self.allocated, self.reserved, self.peak, self.util = allocated, reserved, peak, utilization
        self.reads = 0
        self.fail = False

    def read(self) -> MemoryStats:
        self.reads += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return MemoryStats(self.allocated, self.reserved, self.peak, self.device)

    def empty_cache(self) -> None:
        raise AssertionError("a scrape must never empty the cache")

    def summary(self) -> str:
        return ""

    def utilization(self) -> float | None:
        return self.util


def scrape(metrics: Metrics) -> dict[str, dict[tuple, float]]:
    """name -> {sorted label items -> value}, parsed back from the exposition text as Prometheus would."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        out.setdefault(family.name, {})
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def bound(source: object, tmp_path: Path) -> Metrics:
    settings = make_settings(tmp_path, layered="dev")
    metrics = Metrics()
    MemoryGuard(settings.memory, source).bind(metrics)  # type: ignore[arg-type]
    return metrics


@pytest.mark.parametrize(("maximum", "buckets"), [
    (32, (1, 2, 4, 8, 16, 32)),
    (24, (1, 2, 4, 8, 16, 24)),
    (1, (1,)),
    (300, (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)),
])
def test_batch_size_buckets_run_from_one_to_the_maximum(maximum: int, buckets: tuple) -> None:
    assert batch_size_buckets(maximum) == buckets
    metrics = Metrics(maximum)
    metrics.batch_size.labels("m", "v1").observe(1)
    edges = [dict(labels)["le"] for labels in scrape(metrics)["inferd_batch_size_bucket"]]
    assert [float(e) for e in edges] == [*map(float, buckets), float("inf")]


def test_latency_buckets_span_milliseconds_to_tens_of_seconds() -> None:
    assert LATENCY_BUCKETS[0] <= 0.001 and LATENCY_BUCKETS[-1] >= 30
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


def test_gpu_figures_are_read_at_scrape_time(tmp_path: Path) -> None:
    source = SettableStats(allocated=600, reserved=1000, peak=800, utilization=0.75)
    metrics = bound(source, tmp_path)
    got = scrape(metrics)
    label = (("device", "cuda:0"),)
    assert got["inferd_gpu_memory_allocated_bytes"][label] == 600
    assert got["inferd_gpu_memory_reserved_bytes"][label] == 1000
    assert got["inferd_gpu_memory_peak_bytes"][label] == 800
    assert got["inferd_gpu_memory_fragmentation_ratio"][label] == pytest.approx(0.4)
    assert got["inferd_gpu_utilization_ratio"][label] == 0.75
    # No request ran in between: the next scrape still sees the new figures.
    source.allocated, source.reserved, source.util = 900, 1000, None
    got = scrape(metrics)
    assert got["inferd_gpu_memory_allocated_bytes"][label] == 900
    assert got["inferd_gpu_memory_fragmentation_ratio"][label] == pytest.approx(0.1)
    assert got["inferd_gpu_utilization_ratio"] == {}  # NVML could not say: no sample, not a made-up 0
    assert source.reads == 2


def test_on_cpu_gpu_families_are_declared_without_samples(tmp_path: Path) -> None:
    for metrics in (Metrics(), bound(ProcessStats(), tmp_path)):
        got = scrape(metrics)
        for name, _ in GPU_METRICS.values():
            assert got[name] == {}, name
        assert next(iter(got["process_resident_memory_bytes"].values())) > 0


def test_a_failing_device_read_does_not_break_the_scrape(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = SettableStats(allocated=1, reserved=2, peak=3)
    source.fail = True
    metrics = bound(source, tmp_path)
    metrics.requests.labels("/predict", "200", "").inc()
    with caplog.at_level(logging.WARNING, logger="inferd.utils.metrics"):
        for _ in range(3):
            got = scrape(metrics)
    assert got["inferd_requests_total"][(("endpoint", "/predict"), ("model", ""), ("status", "200"))] == 1
    assert got["inferd_gpu_memory_allocated_bytes"] == {}
    assert len([r for r in caplog.records if "device memory" in r.getMessage()]) == 1  # logged once, not per scrape
    source.fail = False
    assert scrape(metrics)["inferd_gpu_memory_allocated_bytes"] == {(("device", "cuda:0"),): 1}


def test_reasons_and_empty_cache_start_at_zero() -> None:
    got = scrape(Metrics())
    rejected = got["inferd_requests_rejected_total"]
    for reason in ("overloaded", "deadline", "disconnected", "too_long", "invalid"):
        assert reason in REJECT_REASONS
        assert rejected[(("reason", reason),)] == 0
    assert got["inferd_empty_cache_total"] == {(("reason", "fragmentation"),): 0, (("reason", "oom"),): 0}


def test_each_app_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.oom.inc()
    assert a.registry.get_sample_value("inferd_oom_total") == 1
    assert b.registry.get_sample_value("inferd_oom_total") == 0


def test_the_issues_metric_names_are_exported() -> None:
    names = set(scrape(Metrics()))
    required = {
        "inferd_requests", "inferd_request_duration_seconds", "inferd_queue_duration_seconds",
        "inferd_preprocess_duration_seconds", "inferd_inference_duration_seconds",
        "inferd_postprocess_duration_seconds", "inferd_batch_size", "inferd_batch_tokens", "inferd_queue_depth",
        "inferd_requests_rejected", "inferd_model_info", "inferd_model_load_seconds",
        "inferd_gpu_memory_allocated_bytes", "inferd_gpu_memory_reserved_bytes", "inferd_gpu_memory_peak_bytes",
        "inferd_gpu_memory_fragmentation_ratio", "inferd_gpu_utilization_ratio", "inferd_empty_cache",
        "process_resident_memory_bytes",
    }
    assert required <= names, sorted(required - names)
