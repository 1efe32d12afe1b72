"""What one OpenVINO call costs beside its tokens, and what a lone request loses on one thread instead of two.

    python bench/openvino_calls.py [--dtype bfloat16] [--calls 50] [--rounds 3]

The packaged MiniLM is exported once through inferd's own loader (prod overlay, ``model.cache_dir`` a temporary
folder) and its graph compiled here as the server compiles it. Three measurements, in process, no server:

1. **Per call**: one compiled model of one stream and one thread, the same shape called ``--calls`` times: the
   milliseconds a call takes at shapes from 1 x 5 to 32 x 20 tokens, and per token. What does not scale with the
   tokens is the call's own cost (every operator's shape inference and dispatch on dynamic shapes).
2. **A changing shape**: 4 x 20 tokens every call, against 4 x 20 and 4 x 22 alternating on one request, and
   on two requests each keeping its shape: what a new shape costs a call on top.
3. **A lone request**: one text at a time (lengths drawn like the corpus's), on the one-stream twin of two threads
   (what an instance running alone uses, core/instances.py ``Sharing``) against one stream of a two-stream model
   (one instance's one thread), alternated per round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def exported(dtype: str, cache: Path) -> Path:
    """The packaged MiniLM's OpenVINO graph, exported (and gated) by inferd's loader into ``cache``."""
    from inferd.config import load_settings
    from inferd.core.loading import load_handler
    from inferd.core.spec import spec_from_settings

    env = {"INFERD__MODEL__DEVICE": "cpu", "INFERD__MODEL__BACKEND": "openvino", "INFERD__MODEL__DTYPE": dtype,
           "INFERD__MODEL__CACHE_DIR": str(cache)}
    load_handler(spec_from_settings(load_settings("prod", environ=env))).close()
    return next(cache.rglob("*.xml"))


def per_call_ms(request: object, feed: dict[str, np.ndarray], calls: int) -> float:
    for _ in range(5):
        request.infer(feed)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for _ in range(calls):
        request.infer(feed)  # type: ignore[attr-defined]
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (default bfloat16)")
    p.add_argument("--calls", type=int, default=50, help="calls per measurement (50)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the lone-request comparison (3)")
    args = p.parse_args(argv)
    import openvino as ov

    graph = exported(args.dtype, Path(tempfile.mkdtemp(prefix="inferd-ov-calls-")))
    core = ov.Core()
    model = core.read_model(str(graph))
    names = [i.get_any_name() for i in model.inputs]
    base = {"INFERENCE_PRECISION_HINT": "bf16" if args.dtype == "bfloat16" else "f32", "PERFORMANCE_HINT": "LATENCY"}

    def feed(rows: int, cols: int) -> dict[str, np.ndarray]:
        return {n: np.ones((rows, cols), dtype=np.int64) for n in names}

    one = core.compile_model(model, "CPU", {**base, "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": 1})
    request = one.create_infer_request()
    print("1. per call, one stream of one thread, the same shape every call\n")
    print("| rows x tokens | ms a call | ms a token |\n|---|---|---|")
    for rows, cols in [(1, 5), (1, 20), (1, 60), (4, 5), (4, 20), (16, 20), (32, 20)]:
        ms = per_call_ms(request, feed(rows, cols), args.calls)
        print(f"| {rows} x {cols} | {ms:.2f} | {ms / (rows * cols):.3f} |", flush=True)

    print("\n2. a changing shape (4 x 20 and 4 x 22)\n")
    other = one.create_infer_request()
    a, b = feed(4, 20), feed(4, 22)
    for label, seq in [("one request, the same shape", [(request, a)]),
                       ("one request, the shapes alternating", [(request, a), (request, b)]),
                       ("two requests, each its own shape", [(request, a), (other, b)])]:
        for req, f in seq:
            req.infer(f)
        t0 = time.perf_counter()
        for i in range(args.calls * 2):
            req, f = seq[i % len(seq)]
            req.infer(f)
        print(f"- {label}: {(time.perf_counter() - t0) / (args.calls * 2) * 1e3:.2f} ms a call", flush=True)

    print("\n3. a lone request: one text at a time, on two threads (the twin) or on one (an instance's share)\n")
    wide = core.compile_model(model, "CPU", {**base, "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": 2})
    narrow = core.compile_model(model, "CPU", {**base, "NUM_STREAMS": "2", "INFERENCE_NUM_THREADS": 2})
    rng = random.Random(0)
    lengths = [max(5, min(250, int(rng.lognormvariate(3.7, 0.8)))) for _ in range(150)]

    def lone(req: object) -> tuple[float, float]:
        times = []
        for n in lengths:
            t0 = time.perf_counter()
            req.infer(feed(1, n))  # type: ignore[attr-defined]
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return statistics.median(times), times[int(len(times) * 0.99)]

    requests = {"two threads (twin)": wide.create_infer_request(), "one thread": narrow.create_infer_request()}
    for req in requests.values():
        lone(req)
    print("| round | two threads P50 / P99 ms | one thread P50 / P99 ms | one / two, P50 |\n|---|---|---|---|")
    for r in range(args.rounds):
        got = {k: lone(v) for k, v in (list(requests.items())[::-1] if r % 2 else requests.items())}
        two, single = got["two threads (twin)"], got["one thread"]
        print(f"| {r + 1} | {two[0]:.1f} / {two[1]:.1f} | {single[0]:.1f} / {single[1]:.1f} | "
              f"{single[0] / two[0]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
