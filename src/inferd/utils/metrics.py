"""Prometheus metrics, named ``inferd_<noun>_<unit>``; one registry per app so tests can run many apps.

Queue, preprocess, inference and postprocess durations are kept apart so a dashboard shows where the
time goes; rejections carry a reason label.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

# Half a millisecond (a queue wait on an idle server) to tens of seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Cosine between two models' vectors of a text: most of the interesting range lies between 0.99 and 1.
COSINE_BUCKETS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9999, 1.0)
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

log = logging.getLogger(__name__)

EMPTY_CACHE_REASONS = ("fragmentation", "oom")
GPU_METRICS = {
    "allocated": ("inferd_gpu_memory_allocated_bytes", "Device memory held by tensors"),
    "reserved": ("inferd_gpu_memory_reserved_bytes", "Device memory reserved by the caching allocator"),
    "peak": ("inferd_gpu_memory_peak_bytes", "Peak device memory held by tensors since start"),
    "fragmentation": ("inferd_gpu_memory_fragmentation_ratio", "(reserved - allocated) / reserved"),
    "utilization": ("inferd_gpu_utilization_ratio", "Fraction of time a kernel ran (NVML), 0-1"),
}

REJECT_REASONS = ("overloaded", "deadline", "disconnected", "too_long", "invalid", "not_ready", "draining",
                  "oom", "unauthorized", "rate_limited")


def batch_size_buckets(max_batch_size: int) -> tuple[float, ...]:
    edges = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, max_batch_size}
    return tuple(sorted(e for e in edges if e <= max_batch_size))


class Metrics:
    def __init__(self, max_batch_size: int = 32, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        # model: the served model that answered or refused it ("" before one was chosen: health, bad bodies, names
        # not served; only configured names, so a scan of made-up names cannot grow the series).
        self.requests = Counter("inferd_requests_total", "HTTP requests by endpoint, status and model",
                                ["endpoint", "status", "model"], registry=r)
        self.request_duration = Histogram("inferd_request_duration_seconds", "Request duration",
                                          ["endpoint", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_duration = Histogram("inferd_queue_duration_seconds", "Time a text waited in the queue",
                                        ["model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.preprocess_duration = Histogram("inferd_preprocess_duration_seconds",
                                             "Tokenisation time per request", ["model", "version"],
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inference_duration = Histogram("inferd_inference_duration_seconds", "Forward pass per batch",
                                            ["model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.postprocess_duration = Histogram("inferd_postprocess_duration_seconds",
                                              "handler.postprocess time per batch", ["model", "version"],
                                              buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("inferd_batch_size", "Texts per batch", ["model", "version"],
                                    buckets=batch_size_buckets(max_batch_size), registry=r)
        self.batch_tokens = Histogram("inferd_batch_tokens", "Padded tokens per batch", ["model", "version"],
                                      buckets=TOKEN_BUCKETS, registry=r)
        # Per model: the HPA and KEDA queries sum it over models (deploy/k8s/README.md).
        self.queue_depth = Gauge("inferd_queue_depth", "Texts waiting in a model's batch queue", ["model"],
                                 registry=r)
        self.in_flight = Gauge("inferd_requests_in_flight", "Inference requests accepted, not answered",
                               registry=r)
        self.rejected = Counter("inferd_requests_rejected_total", "Requests refused or dropped",
                                ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.model_info = Gauge("inferd_model_info", "The model being served (value 1)",
                                ["model", "slot", "version", "device", "dtype", "backend", "quantize", "task"],
                                registry=r)
        # The accuracy gate's figures for a converted model (onnx/openvino) against torch fp32.
        self.model_gate = Gauge("inferd_model_gate_ratio", "Accuracy gate figures against torch fp32",
                                ["model", "version", "figure"], registry=r)
        self.model_load = Gauge("inferd_model_load_seconds", "Duration of the last model load",
                                ["model", "version"], registry=r)
        self.model_reloads = Counter("inferd_model_reloads_total", "Model reloads by outcome",
                                     ["outcome"], registry=r)
        self.task_items = Counter("inferd_task_items_total", "Inputs answered per model and task (texts, or "
                                  "query/document pairs for rerank)", ["model", "task"], registry=r)
        self.output_items = Counter("inferd_output_items_total", "Texts an embedding model answered per output "
                                    "asked: dense, sparse, multivector (one pass may give several)",
                                    ["model", "output"], registry=r)
        self.version_requests = Counter("inferd_version_requests_total", "Inference requests per model version",
                                        ["model", "version"], registry=r)
        # GPU figures are read when Prometheus scrapes (the memory guard's source), not kept by the hot path.
        self.device = DeviceCollector()
        r.register(self.device)
        self.empty_cache = Counter("inferd_empty_cache_total", "empty_cache calls made by the memory guard",
                                   ["reason"], registry=r)
        for reason in EMPTY_CACHE_REASONS:
            self.empty_cache.labels(reason)
        self.oom = Counter("inferd_oom_total", "Out-of-memory errors caught in batches", registry=r)
        # The one cache in the process is the optional embedding LRU (core/cache.py, cache.max_entries).
        self.cache_entries = Gauge("inferd_cache_entries", "Entries held by bounded caches", ["cache"],
                                   registry=r)
        self.cache_hits = Counter("inferd_cache_hits_total", "Texts answered from a cache", ["cache"], registry=r)
        self.cache_misses = Counter("inferd_cache_misses_total", "Texts looked up and not found", ["cache"],
                                    registry=r)
        self.worker_alive = Gauge("inferd_worker_alive", "1 while the inference worker thread runs",
                                  registry=r)
        # Per tenant (core/tenants.py): names from the configuration only, so no caller can add a series.
        self.tenant_requests = Counter("inferd_tenant_requests_total", "Requests a tenant had answered by a model",
                                       ["tenant", "model"], registry=r)
        self.tenant_tokens = Counter("inferd_tenant_tokens_total", "Tokens a model ran for a tenant (after "
                                     "truncation)", ["tenant", "model"], registry=r)
        self.tenant_rejected = Counter("inferd_tenant_rejected_total", "A tenant's requests refused by its own "
                                       "limits, by reason", ["tenant", "reason"], registry=r)
        # Per model instance (core/instances.py); instance "shadow" is the shadow lanes' own.
        self.instance_busy = Counter("inferd_instance_busy_seconds_total", "Seconds an instance spent running "
                                     "batches", ["model", "instance"], registry=r)
        self.instance_batches = Counter("inferd_instance_batches_total", "Batches an instance ran",
                                        ["model", "instance"], registry=r)
        self.instance_queue_wait = Histogram("inferd_instance_queue_wait_seconds", "Time a text waited in the "
                                             "queue before an instance took its batch", ["model", "instance"],
                                             buckets=LATENCY_BUCKETS, registry=r)
        # Shadow traffic (core/shadow.py): mirrored requests by outcome, and the drift report's figures.
        self.shadow_requests = Counter("inferd_shadow_requests_total", "Live requests mirrored to a model's shadow "
                                       "candidate, by outcome (sampled, computed, shed, failed)",
                                       ["model", "outcome"], registry=r)
        self.shadow_cosine = Histogram("inferd_shadow_cosine_ratio", "Cosine per text between the active and the "
                                       "shadow candidate's vectors", ["model"], buckets=COSINE_BUCKETS, registry=r)
        self.shadow_figures = Gauge("inferd_shadow_agreement_ratio", "The shadow candidate's drift figures "
                                    "(cosine, neighbour overlap, Spearman, top-3, label agreement, deltas)",
                                    ["model", "figure"], registry=r)
        self.shadow_queue_depth = Gauge("inferd_shadow_queue_depth", "Texts waiting in a model's shadow lane",
                                        ["model"], registry=r)
        # Batch jobs (src/inferd/jobs/): jobs by state and the backlog, as the store holds them (every worker's,
        # refreshed by the runner); lines this process ran, by outcome (rate(): lines/s); its recent lines/s.
        self.jobs = Gauge("inferd_jobs", "Batch jobs in the job store by state", ["state"], registry=r)
        self.job_lines = Counter("inferd_job_lines_total", "Batch job lines this process finished, by outcome "
                                 "(ok, failed)", ["outcome"], registry=r)
        self.job_lines_rate = Gauge("inferd_job_lines_per_second", "Lines/s this process ran batch lines at, over "
                                    "its last chunk", registry=r)
        self.job_backlog = Gauge("inferd_job_backlog_lines", "Lines of running batch jobs not yet done", registry=r)

    def forget_shadow(self, model: str) -> None:
        """A shadow candidate dropped or promoted: its figures go (the counters stay: they only grow)."""
        for family in (self.shadow_cosine, self.shadow_queue_depth):
            with contextlib.suppress(KeyError):
                family.remove(model)
        for labels in [k for k in self.shadow_figures._metrics if k[0] == model]:  # noqa: SLF001
            self.shadow_figures.remove(*labels)

    def forget_version(self, model: str, version: str) -> None:
        """Remove every series labelled with a model's version no loaded slot of it carries any more."""
        for family in (self.queue_duration, self.preprocess_duration, self.inference_duration,
                       self.postprocess_duration, self.batch_size, self.batch_tokens, self.model_load,
                       self.version_requests):
            with contextlib.suppress(KeyError):  # a version that never saw a request has no series
                family.remove(model, version)


class AutoCollector:
    """backend auto's verdicts (core/backends/auto.py), read when Prometheus scrapes: one sample of 1 per model and
    candidate, labelled with its state (serving, refused, skipped, judging, pending). The reasons are /info's: text
    is no label value."""

    def __init__(self, source: Callable[[], list[tuple[str, list[dict[str, Any]]]]]) -> None:
        self.source = source

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("inferd_auto_candidate", "backend auto: each candidate runtime's state (value 1)",
                                 labels=["model", "candidate", "state"])

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for model, candidates in self.source():
            for c in candidates:
                family.add_metric([model, c["candidate"], c["state"]], 1)
        yield family


class DeviceCollector:
    """GPU memory and utilisation, read from ``source`` (the memory guard) each time Prometheus scrapes.

    The families are always declared, so dashboards and alerts see the names; on a machine without a GPU
    (source device "cpu", or no source) they carry no samples rather than a misleading zero.
    """

    def __init__(self, source: Any = None) -> None:
        self.source = source
        self._failed = False

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {key: GaugeMetricFamily(name, doc, labels=["device"]) for key, (name, doc) in GPU_METRICS.items()}

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families().values()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        source = self.source
        if source is not None:
            try:
                stats = source.read()
                if stats.device != "cpu":
                    label = [stats.device]
                    families["allocated"].add_metric(label, stats.allocated)
                    families["reserved"].add_metric(label, stats.reserved)
                    families["peak"].add_metric(label, stats.peak)
                    families["fragmentation"].add_metric(label, stats.fragmentation)
                    utilization = source.utilization()
                    if utilization is not None:
                        families["utilization"].add_metric(label, utilization)
                self._failed = False
            except Exception:  # a scrape must never fail because a device figure could not be read
                if not self._failed:
                    log.warning("reading device memory figures failed", exc_info=True)
                self._failed = True
        yield from families.values()
