"""A job's pass on every thread beside one-text live passes, with OpenVINO's TBB partitioner static or auto (issue 42).

    python bench/tbb_partitioner.py [--partitioners STATIC,AUTO] [--rounds 3]

A job's batch on the one-stream graph of two threads meets its two threads at a barrier after each operation: a live
pass that takes one core from the niced job stalls it on both. ``TBB_PARTITIONER`` AUTO lets the thread that is not
held take over work of the one that is (STATIC, the default, splits each operation evenly and waits). A closed
harness, MiniLM as ``mixed`` (bench/packed_graph.py's padded export): the job (sorted batches of 32 corpus texts on
the two-thread graph, at nice 19) alone, then beside one-text live passes (Poisson at 44/s on a graph of two
one-thread streams, nice 0), then the live passes alone; 8 s windows, the partitioners' order rotated each round.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from packed_graph import Padded, compiled, feed, load_model, padded_example

from inferd import corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--partitioners", default="STATIC,AUTO")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=44.0, help="live passes a second")
    args = p.parse_args()
    import openvino as ov

    torch.set_num_threads(1)
    tok, model = load_model()
    core, work = ov.Core(), Path(tempfile.mkdtemp(prefix="tbb-partitioner-"))
    live_graph = compiled(core, work, "padded", Padded(model), padded_example(), streams=2, threads=1)
    names = args.partitioners.split(",")
    wide = {n: compiled(core, work, "padded", Padded(model), padded_example(), threads=2, TBB_PARTITIONER=n)
            for n in names}
    enc = [tok(t, truncation=True, max_length=256)["input_ids"] for t in corpus.texts(2048)]
    ordered = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    job_batches = [feed(enc, ordered[k:k + 32]) for k in range(0, len(ordered), 32)]
    live_feeds = [feed(enc, [i]) for i in range(len(enc))]

    def job(graph: Any, stop: threading.Event, done: list[int]) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        request, k = graph.create_infer_request(), 0
        while not stop.is_set():
            batch = job_batches[k % len(job_batches)]
            request.infer(batch, share_inputs=True)
            done[0] += batch["input_ids"].shape[0]
            k += 1

    def live(stop: threading.Event, latencies: list[float]) -> None:
        request, k, due = live_graph.create_infer_request(), 0, time.perf_counter()
        rng = random.Random(0)
        while not stop.is_set():
            due += rng.expovariate(args.rate)
            time.sleep(max(0.0, due - time.perf_counter()))
            t0 = time.perf_counter()
            request.infer(live_feeds[k % len(live_feeds)], share_inputs=True)
            latencies.append(time.perf_counter() - t0)
            k += 1

    def phase(graph: Any, with_job: bool, with_live: bool, seconds: float = 8.0) -> tuple[float, float | None]:
        stop, done, latencies = threading.Event(), [0], []
        threads = ([threading.Thread(target=job, args=(graph, stop, done))] if with_job else []) + \
                  ([threading.Thread(target=live, args=(stop, latencies))] if with_live else [])
        for t in threads:
            t.start()
        time.sleep(1.0)
        d0, l0, t0 = done[0], len(latencies), time.perf_counter()
        time.sleep(seconds)
        rate, window = (done[0] - d0) / (time.perf_counter() - t0), sorted(latencies[l0:])
        stop.set()
        for t in threads:
            t.join()
        return rate, (window[int(len(window) * 0.99)] * 1000 if window else None)

    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            alone, _ = phase(wide[name], True, False)
            both, p99_both = phase(wide[name], True, True)
            _, p99_alone = phase(wide[name], False, True)
            assert p99_both is not None and p99_alone is not None
            print(f"{name}: job alone {alone:.0f} texts/s, beside live passes {both:.0f} (x{both / alone:.2f}); "
                  f"live P99 {p99_alone:.1f} -> {p99_both:.1f} ms (x{p99_both / p99_alone:.2f})", flush=True)


if __name__ == "__main__":
    main()
