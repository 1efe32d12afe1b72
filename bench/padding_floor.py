"""What ``batching.min_padding_efficiency`` costs or saves a CPU server: the same server under each floor, rounds
alternated, measured from outside and from /proc.

    python bench/padding_floor.py [--floors 0.8,0.9,0.95] [--backend openvino:bfloat16] [--rounds 3]

Each round starts one ``inferd serve`` per floor (prod overlay, the packaged MiniLM, the order rotated each round),
warms it, and runs the benchmark's closed loop: 32 clients, one corpus text per request. Per floor: texts/s, the
batches the server formed (mean size, real / padded tokens, from its /metrics), and CPU milliseconds per request
split between the event loop (the main thread) and every other thread (the instances' workers and the runtime's
compute threads), read from /proc/<pid>/task. The ratios are to the first floor within each round (the machine is
shared: minutes apart differ more than configurations do).

A higher floor forms smaller batches of closer lengths: less padding, more calls. On a CPU a padded token costs
what a real one does, and a call costs a few milliseconds whatever its size (OpenVINO: ~3 ms, ~2.5 ms more when the
shape differs from the last call's), so the best floor is where the two balance; on a GPU padding is nearly free
until the device is full, hence its lower floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from inferd import corpus  # noqa: E402
from inferd.bench.load import Target, TextSource, run_closed  # noqa: E402
from inferd.bench.procs import start_inferd, thread_cpu  # noqa: E402


def loop_and_rest(pid: int) -> tuple[float, float]:
    """(event loop, everything else) CPU seconds of a process so far: its main thread, and the sum of the rest."""
    by_name = thread_cpu(pid)
    loop = by_name.pop("main", 0.0)
    return loop, sum(by_name.values())


def measure(url: str, pid: int, source: TextSource, duration: float, warmup: float) -> dict[str, float]:
    run_closed(Target(url), source, 32, 1, warmup, 0.0)
    loop0, rest0 = loop_and_rest(pid)
    result = run_closed(Target(url), source, 32, 1, duration, 0.0)
    loop1, rest1 = loop_and_rest(pid)
    n = max(1, result["requests"])
    return {"texts_per_s": result["texts_per_s"], "p99_ms": result["p99_ms"],
            "batch": result["mean_batch_size"], "padding": result["padding_efficiency"],
            "loop_ms": (loop1 - loop0) / n * 1e3, "compute_ms": (rest1 - rest0) / n * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--floors", default="0.8,0.9,0.95", help="min_padding_efficiency values (the first is the base)")
    p.add_argument("--backend", default="openvino:bfloat16", help="BACKEND[:DTYPE] (default openvino:bfloat16)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="seconds measured per server (8)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement (2)")
    args = p.parse_args(argv)
    floors = [float(f) for f in args.floors.split(",")]
    backend, _, dtype = args.backend.partition(":")
    logs = Path(tempfile.mkdtemp(prefix="inferd-padding-floor-"))
    env = {"INFERD__MODEL__BACKEND": backend, "INFERD__MODEL__CACHE_DIR": str(logs / "cache"),
           **({"INFERD__MODEL__DTYPE": dtype} if dtype else {})}
    texts = corpus.texts(2000)
    tokens = [corpus.estimate_tokens(t) for t in texts]
    start_inferd(logs, None, None, env, timeout=1800).stop()  # the export and the gate, once, outside the rounds
    rows: dict[float, list[dict[str, float]]] = {f: [] for f in floors}
    for r in range(args.rounds):
        for floor in floors[r % len(floors):] + floors[: r % len(floors)]:
            server = start_inferd(logs, None, None, {**env, "INFERD__BATCHING__MIN_PADDING_EFFICIENCY": str(floor)},
                                  timeout=600)
            try:
                got = measure(server.url, server.proc.pid, TextSource(texts, tokens, seed=r), args.duration,
                              args.warmup)
            finally:
                server.stop()
            rows[floor].append(got)
            print(f"round {r + 1}: floor {floor}: {got['texts_per_s']:.1f} texts/s, batch {got['batch']}, padding "
                  f"{got['padding']}, CPU ms/request loop {got['loop_ms']:.2f} compute {got['compute_ms']:.2f}",
                  flush=True)
    base = rows[floors[0]]
    print(f"\n{args.backend}, closed loop 32 clients x 1 text, {args.rounds} rounds of {args.duration:g} s; "
          f"median (range); x = over floor {floors[0]} in the same round\n")
    print("| floor | texts/s | x | P99 ms | mean batch | real/padded | loop CPU ms/req | compute CPU ms/req | x |")
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(values: list[float], digits: int = 1) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    for floor, got in rows.items():
        tps = [g["texts_per_s"] / b["texts_per_s"] for g, b in zip(got, base, strict=True)]
        cpu = [g["compute_ms"] / b["compute_ms"] for g, b in zip(got, base, strict=True)]
        print(f"| {floor:g} | {cell([g['texts_per_s'] for g in got])} | {cell(tps, 2)} | "
              f"{cell([g['p99_ms'] for g in got], 0)} | {cell([g['batch'] for g in got])} | "
              f"{cell([g['padding'] for g in got], 2)} | {cell([g['loop_ms'] for g in got], 2)} | "
              f"{cell([g['compute_ms'] for g in got], 2)} | {cell(cpu, 2)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
