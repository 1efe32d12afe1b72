"""``inferd prepare``: fill the cache a server will start from, so it starts warm (an image build, an init container,
a Kubernetes Job writing a shared volume).

For ``model.backend: auto`` it judges the candidates a server on this machine would judge, in the same order, and
stops at the first the gate passes (core/backends/auto.py), keeping that choice in the cache: a server started on
it with the same settings serves the passed graph from its first answer, loading no torch and judging nothing.
For any other backend it is ``inferd export``. Each candidate is loaded as ``inferd export`` loads one (no
warm-up); the entries' lock (core/backends/cache_entries.py ``entry_lock``) lets several run at once on one cache
without exporting twice.

Exit status: 0 when the cache is ready (a candidate passed, or every one was refused by the gate or skipped on this
machine: torch will serve at once, judging nothing); 1 when a candidate could not be made for another reason (a cache
folder that cannot be written, a model that does not load: a server would try again at every start), which stops the
walk there, its reason said once; 2 for a configuration refused, as the server's load refuses it (core/backends/
factory.py ``check_load``: a dtype the backend cannot run, a quantisation torch cannot do), before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import torch

from inferd.core.backends.auto import Verdict, candidates, device_type, follows_from, remember
from inferd.core.backends.base import BackendError, cpu_flags, options_for
from inferd.core.backends.factory import check_load
from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec, spec_from_settings
from inferd.settings import Settings

# How a gate refusal reads (factory.open_backend): a verdict, cached; any other failure is not one.
GATE_REFUSAL = "refused by the accuracy gate"


def judge(spec: ModelSpec, runtime: dict[str, str]) -> dict[str, Any]:
    """One candidate's load into the cache: its verdict, and what the load says (the cache entry, the figures)."""
    started = time.monotonic()
    try:
        handler = load_handler(dataclasses.replace(spec, warmup=False, **runtime))
    except Exception as exc:  # any failure is this candidate's verdict, said in one line, never a traceback
        reason = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
        state = "refused" if GATE_REFUSAL in reason else "failed"
        return {"state": state, "reason": reason, "seconds": round(time.monotonic() - started, 3)}
    info = dict(handler.loaded.backend_info or {})
    handler.close()
    return {"state": "passed", "seconds": round(time.monotonic() - started, 3), "cache": info.get("cache"),
            "cache_entry": info.get("cache_entry"), "gate": info.get("gate")}


def refusal(spec: ModelSpec) -> str | None:
    """Why the server's load would refuse these settings before loading anything (``check_load``), or None. The
    device is the one that load resolves: a converted backend's ``auto`` is the CPU; torch's is CUDA where there is
    one (not asked to be there: an init container may have no GPU its server will have)."""
    if spec.device != "auto":
        device = torch.device(spec.device)
    else:
        device = torch.device(device_type(spec) if spec.backend in ("torch", "auto") else "cpu")
    try:
        check_load(options_for(spec), device)
    except BackendError as exc:
        return str(exc)
    return None


def prepare(settings: Settings) -> int:
    spec = spec_from_settings(settings)
    refused = refusal(spec)
    if refused is not None:
        print(f"inferd prepare: {refused}", file=sys.stderr)
        return 2
    if settings.model.backend != "auto":
        runtime = {"backend": spec.backend, "dtype": spec.dtype, "quantize": spec.quantize}
        if spec.backend == "torch":
            print(json.dumps({"ready": True, "runtime": "torch", "note": "torch needs no export"}, indent=2))
            return 0
        # One backend asked for, as ``inferd export``: a refusal leaves the server nothing to start on, so it fails.
        verdict = judge(spec, runtime)
        if verdict["state"] != "passed":
            print(f"inferd prepare: {verdict['state']}: {verdict['reason']}", file=sys.stderr)
        print(json.dumps({"ready": verdict["state"] == "passed", **verdict}, indent=2))
        return 0 if verdict["state"] == "passed" else 1
    try:
        todo, skipped = candidates(cpu_flags(), device_type(spec) == "cuda", settings.model.auto_candidates)
    except ValueError as exc:
        print(f"inferd prepare: {exc}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"serves": "torch-float32", "candidates": {}}
    for candidate in [c for c in todo if c.backend == "torch"]:
        # A GPU's torch float16 is no export: nothing to put in the cache (and an init container has no GPU).
        todo.remove(candidate)
        skipped[candidate.name] = "torch needs no export: nothing to cache"
    for candidate in todo:
        if candidate.name in skipped:  # settled by an earlier refusal (follows_from)
            continue
        verdict = judge(spec, candidate.runtime())
        out["candidates"][candidate.name] = verdict
        said = f"inferd prepare: {candidate.name} {verdict['state']} in {verdict['seconds']} s"
        if verdict["state"] == "failed":
            # Not the gate's verdict: a cache folder that cannot be written, a model folder that is not there.
            # What failed one candidate fails the next alike, so the walk stops and says it once.
            print(f"{said}: {verdict['reason']}", file=sys.stderr)
            for later in todo[todo.index(candidate) + 1:]:
                skipped.setdefault(later.name, f"not judged: {candidate.name} failed first")
            break
        print(said, file=sys.stderr)
        if verdict["state"] == "passed":
            out["serves"] = candidate.name
            # A server starts on it at once, and says why the others do not serve (its /info, as a judging would).
            for later in todo[todo.index(candidate) + 1:]:  # printed below, and kept with the choice
                skipped.setdefault(later.name, f"not judged: {candidate.name}, ranked faster, passed first")
            others = [*(Verdict(n, v["state"], v.get("reason")) for n, v in out["candidates"].items()),
                      *(Verdict(n, "skipped", why) for n, why in skipped.items())]
            remember(spec, candidate.name, verdict.get("cache_entry"), others)
            break
        skipped.update(follows_from(candidate.name, verdict["reason"]))
    out["candidates"].update({name: {"state": "skipped", "reason": why} for name, why in skipped.items()})
    failed = [name for name, v in out["candidates"].items() if v["state"] == "failed"]
    out["ready"] = not failed
    print(json.dumps(out, indent=2))
    return 1 if failed else 0
