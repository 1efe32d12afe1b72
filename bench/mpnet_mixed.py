"""all-mpnet-base-v2 on OpenVINO mixed precision (``model.dtype: mixed``: bf16 with the position-bucket arithmetic
in float32) against torch fp32 and plain OpenVINO bf16: the gate's verdict and figures for each (default bounds, the
server's own gate code), then in-process texts/s (tokenise, sorted batches of 32, pool) in rotating rounds.

The figures behind docs/backends.md, "A base-size model on bf16". Needs a CPU with native bf16 (elsewhere
OpenVINO runs float32 and mixed is float32). ``python bench/mpnet_mixed.py [--seconds 20] [--rounds 3]``:
two cold starts (export and the gate, minutes on two cores) then the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

from inferd.bench.backends import in_process
from inferd.bench.mpnet import mpnet_folder
from inferd.core.backends.base import BackendError
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.corpus import texts as corpus_texts

CONFIGS: dict[str, dict[str, str]] = {"torch fp32": {}, "openvino bf16": {"backend": "openvino", "dtype": "bfloat16"},
                                      "openvino mixed": {"backend": "openvino", "dtype": "mixed"}}


def load(folder: Any, cache: str, **kw: Any) -> tuple[Any, dict[str, Any]]:
    started = time.perf_counter()
    try:
        handler = load_handler(ModelSpec(folder, "1", name="mpnet", device="cpu", warmup=False, cache_dir=cache,
                                         **kw))
    except BackendError as exc:
        return None, {"refused": str(exc)[:600], "seconds": round(time.perf_counter() - started, 1)}
    info = handler.loaded.backend_info or {}
    return handler, {"seconds": round(time.perf_counter() - started, 1), "gate": info.get("gate"),
                     "kept_float32": info.get("kept_float32")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="in-process measurement per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--texts", type=int, default=256, help="corpus texts per in-process pass")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--cache", help="export cache to keep between runs (default: a temporary one, cold starts)")
    args = p.parse_args()
    folder = mpnet_folder()
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    handlers: dict[str, Any] = {}
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as temporary:
        cache = args.cache or temporary
        for name, kw in configs.items():
            handler, report[name] = load(folder, cache, **kw)
            print(name, json.dumps(report[name], default=str)[:800], file=sys.stderr, flush=True)
            if handler is not None:
                handlers[name] = handler
        texts = corpus_texts(args.texts, seed=99)
        rates: dict[str, list[float]] = {name: [] for name in handlers}
        names = list(handlers)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated, so drift falls on all alike
                rates[name].append(in_process(handlers[name], texts, min_seconds=args.seconds))
    base = rates.get("torch fp32")
    for name, got in rates.items():
        report[name]["texts_per_s"] = [round(v, 1) for v in got]
        if base:
            report[name]["over_torch_fp32"] = round(statistics.median(g / b for g, b in zip(got, base, strict=True)), 2)
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
