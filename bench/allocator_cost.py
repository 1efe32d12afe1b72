"""What glibc's allocator settings cost and save, without HTTP: the packaged MiniLM on batches of ever-different
shapes, in one child process per setting, the settings taking turns (a shared machine's load drifts).

Each child loads the model with inferd's own handler, applies one setting through inferd's ``NativeHeap``
(as ``configure_process`` and the memory guard do in a server), runs ``--batches`` forward passes of random
batch size and text length (seeded: every child sees the same batches), and reports its CPU seconds (user +
system, all threads) and its RSS growth after a warm-up. CPU time, not wall time: other processes on the
machine slow a child down but barely change the work it does.

    .venv/bin/python bench/allocator_cost.py                  # 2 rounds x 4 settings x 100 batches
    .venv/bin/python bench/allocator_cost.py --rounds 1 --batches 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

SETTINGS = {
    # name: (mmap threshold for mallopt, 0 = glibc's dynamic one; trim every N batches, 0 = never)
    "dynamic (glibc default)": (0, 0),
    "trim every batch": (0, 1),
    "trim every 5 batches": (0, 5),
    "mmap threshold 128 KiB": (131072, 0),
}

CHILD = r"""
import json, random, resource, sys, psutil, torch
from inferd.bench.ceiling import load_handler
from inferd.corpus import texts as corpus_texts
from inferd.settings import ModelSettings, resolve_model_path
from inferd.core.memory import NativeHeap
threshold, trim_every, batches, seed = (int(a) for a in sys.argv[1:5])
heap = NativeHeap()
if threshold:
    assert heap.set_mmap_threshold(threshold)
torch.set_num_threads(1)
handler = load_handler(resolve_model_path(ModelSettings()), "cpu", 1)
pool = corpus_texts(3000, 11)
rng = random.Random(seed)
proc = psutil.Process()
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def run(n):
    for i in range(n):
        batch = rng.sample(pool, rng.randint(1, 32))
        handler.postprocess(handler.infer(handler.preprocess(batch)))
        if trim_every and i % trim_every == trim_every - 1:
            heap.trim()
run(batches // 5)  # warm-up: the first batches allocate what any setting keeps
rss0, cpu0 = proc.memory_info().rss, cpu()
run(batches)
print(json.dumps({"cpu_s": cpu() - cpu0, "rss_growth_mb": (proc.memory_info().rss - rss0) / 1e6,
                  "rss_mb": proc.memory_info().rss / 1e6}))
"""


def child(threshold: int, trim_every: int, batches: int, seed: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(threshold), str(trim_every), str(batches), str(seed)],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--json", help="also write every figure here")
    args = p.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS)[r % len(SETTINGS):] + list(SETTINGS)[:r % len(SETTINGS)]  # rotate the turns
        for name in order:
            results[name].append(child(*SETTINGS[name], args.batches, args.seed))
            print(f"round {r + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    base = statistics.median(x["cpu_s"] for x in results["dynamic (glibc default)"])
    print(f"{'setting':30} {'CPU s (median, range)':>26} {'vs default':>10} {'RSS growth MB (median, range)':>31}")
    for name, runs in results.items():
        cpu = [x["cpu_s"] for x in runs]
        growth = [x["rss_growth_mb"] for x in runs]
        print(f"{name:30} {statistics.median(cpu):9.2f} ({min(cpu):6.2f}-{max(cpu):6.2f}) "
              f"{statistics.median(cpu) / base:10.3f} {statistics.median(growth):12.1f} "
              f"({min(growth):6.1f}-{max(growth):6.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
