"""How many instances each model runs and how many threads each gets, from the settings and the cores alone.

Pure arithmetic, without torch, so the fleet can show a worker's split before it starts one
(fleet/layout.py); the engine resolves it once at start (core/instances.py runs the instances).
"""

from __future__ import annotations

import logging
import os

from inferd.settings import ModelEntry, ModelSettings, Settings

log = logging.getLogger(__name__)


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def instance_counts(entries: tuple[ModelEntry, ...], cores: int) -> dict[str, int]:
    """Each model's instances: its own ``model.instances``, or (0) as the measurement chose per runtime
    (bench/RESULTS.md, "Instances, again on a quiet machine"): an OpenVINO model one instance per core of its even
    share of the cores (of ``model.threads`` threads each where it sets them): 1.07-1.23x the texts/s of one
    instance of every thread at 32 clients; any other one instance of all its share, since torch's one-thread
    instances served no more (0.91-1.02x) at 32 clients and less at one (0.59-0.76x)."""
    share = max(1, cores // max(1, len(entries)))

    def auto(model: ModelSettings) -> int:
        # backend auto is laid out for the OpenVINO runtime it switches to (its torch start runs on the same
        # instances: 0.91-1.02x of one instance at 32 clients, per the measurement above).
        return max(1, share // (model.threads or 1)) if model.backend in ("openvino", "auto") else 1

    return {e.name: e.model.instances or auto(e.model) for e in entries}


def thread_budgets(entries: tuple[ModelEntry, ...], cores: int) -> dict[str, int]:
    """Each model's threads per instance: its own ``model.threads``, or the cores left by those that set theirs
    split evenly between the other models' instances (at least one each: more instances than cores time-share)."""
    counts = instance_counts(entries, cores)
    fixed = {e.name: e.model.threads for e in entries if e.model.threads}
    left = cores - sum(fixed[name] * counts[name] for name in fixed)
    shared = sum(counts[e.name] for e in entries if e.name not in fixed)
    even = max(1, left // shared) if shared else 0
    if shared and left < shared:
        log.warning("%d instances share %d cores: each gets one thread and they time-share", shared, max(left, 0))
    return {e.name: fixed.get(e.name, even) for e in entries}


def with_budgets(settings: Settings, cores: int | None = None) -> Settings:
    """``settings`` with every model's ``model.instances`` and ``model.threads`` resolved (0 = chosen from the cores),
    so that the load (OpenVINO's and ONNX Runtime's thread counts) and the workers read one figure."""
    total = cores or settings.runtime.torch_threads or machine_cores()
    counts = instance_counts(settings.served(), total)
    budgets = thread_budgets(settings.served(), total)

    def resolved(entry: ModelEntry, model: ModelSettings) -> ModelSettings:
        return model.model_copy(update={"instances": counts[entry.name], "threads": budgets[entry.name]})

    if settings.models:
        models = tuple(e.model_copy(update={"model": resolved(e, e.model)}) for e in settings.models)
        return settings.model_copy(update={"models": models})
    return settings.model_copy(update={"model": resolved(settings.served()[0], settings.model)})


def describe(settings: Settings, cores: int) -> str:
    """Each model's instances x threads on these cores, for a table: ``embedder 1x1, reranker 1x1``."""
    resolved = with_budgets(settings, cores)
    return ", ".join(f"{e.name} {e.model.instances}x{e.model.threads}" for e in resolved.served())
