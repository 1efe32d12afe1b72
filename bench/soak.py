"""Soak: steady closed-loop load on a real ``inferd serve`` for a bounded time, watching its memory.

Reports the server's RSS over time and its slope (least squares, MB/min) over the run's last third (the goal:
flat within noise once warmed up), the Python heap as tracemalloc sees it (traced bytes at one third and at
the end, and the top-10 allocation sites at the end, from ``GET /admin/memory``), and the requests answered.
When RSS grows while the traced heap stays flat the growth is native (allocator, torch, tokenizer), not
Python objects. A tracemalloc snapshot of a process holding torch takes tens of seconds and hundreds of MB
while it runs, so the server is traced only with ``--tracemalloc`` (a diagnosis run, slower: its RSS figures
are not comparable with an untraced run's), snapshots are taken at one third and after the load has
stopped, and the slope that matters comes from untraced runs.

    .venv/bin/python bench/soak.py                          # 180 s, 8 clients, 4 texts a request
    .venv/bin/python bench/soak.py --duration 600 --json /tmp/soak.json
    .venv/bin/python bench/soak.py --tracemalloc            # leak or fragmentation? (heap figures)
    .venv/bin/python bench/soak.py --server-env INFERD__MEMORY__MALLOC_TRIM_EVERY_N=0   # the fix off

The texts come from the benchmark corpus (log-normal token lengths), drawn at random, so every batch has
another shape: what an embedding service sees, and what feeds an allocator's fragmentation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from inferd.bench.procs import start_inferd
from inferd.corpus import texts as corpus_texts

ADMIN_KEY = "soak-admin-key"


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (None with fewer than 3 points or no spread in xs)."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def rss_slopes(samples: list[tuple[float, int, int]]) -> tuple[float | None, float | None]:
    """RSS growth in MB per minute and in MB per 1,000 requests answered (the latter does not depend on how
    fast a shared machine let the server run: growth from fragmentation follows the batches, not the clock)."""
    mb = [rss / 1e6 for _, rss, _ in samples]
    return (slope([t / 60.0 for t, _, _ in samples], mb), slope([n / 1000.0 for _, _, n in samples], mb))


class Load:
    """``clients`` threads, each a closed loop of POST /v1/embeddings with ``per_request`` random texts."""

    def __init__(self, url: str, pool: list[str], clients: int, per_request: int, seed: int) -> None:
        self.url, self.pool, self.per_request = url, pool, per_request
        self.ok = 0
        self.failed: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True)
                         for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                body = {"input": rng.sample(self.pool, self.per_request), "model": "all-MiniLM-L6-v2"}
                try:
                    r = c.post("/v1/embeddings", json=body)
                    what = "ok" if r.status_code == 200 else str(r.status_code)
                except httpx.HTTPError as exc:
                    what = type(exc).__name__
                with self._lock:
                    if what == "ok":
                        self.ok += 1
                    else:
                        self.failed[what] = self.failed.get(what, 0) + 1


def memory_report(url: str) -> dict[str, Any] | None:
    """The memory guard's report (``GET /admin/memory``): trims done, and the heap when traced."""
    try:
        r = httpx.get(url + "/admin/memory", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=600)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def heap(url: str) -> dict[str, Any] | None:
    report = memory_report(url)
    return report.get("heap") if report else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {"INFERD__CACHE__MAX_ENTRIES": "0", "INFERD__SERVER__ADMIN_KEY": ADMIN_KEY,
           "INFERD__SERVER__ACCESS_LOG": "false", **dict(args.server_env)}
    if args.tracemalloc:
        env["PYTHONTRACEMALLOC"] = "1"  # one frame per allocation: sites, at a modest cost
    log_dir = Path(args.logs or tempfile.mkdtemp(prefix="inferd-soak-"))
    pool = corpus_texts(args.corpus, args.seed)
    server = start_inferd(log_dir, args.model, args.torch_threads, env)
    proc = psutil.Process(server.proc.pid)
    samples: list[tuple[float, int, int]] = []  # (seconds, RSS bytes, requests answered so far)
    load = Load(server.url, pool, args.clients, args.texts, args.seed)
    heap_early: dict[str, Any] | None = None
    heap_end: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    cpu_s = 0.0
    try:
        t0 = time.monotonic()
        samples.append((0.0, proc.memory_info().rss, 0))
        cpu_before = sum(proc.cpu_times()[:2])
        load.start()
        while (now := time.monotonic() - t0) < args.duration:
            time.sleep(min(args.sample_s, max(0.0, args.duration - now)))
            samples.append((time.monotonic() - t0, proc.memory_info().rss, load.ok))
            if args.tracemalloc and heap_early is None and samples[-1][0] >= args.duration / 3:
                heap_early = heap(server.url)
        load.stop()
        elapsed = time.monotonic() - t0
        cpu_s = sum(proc.cpu_times()[:2]) - cpu_before  # user + system: what the server itself spent
        guard = memory_report(server.url)  # after the load: a heap snapshot takes a while
        heap_end = guard.get("heap") if guard else None
    finally:
        load.stop()
        server.stop()
    last = [s for s in samples if s[0] >= args.duration * 2 / 3]
    rss = [r for _, r, _ in samples]
    per_min, per_1k = rss_slopes(last)
    whole_min, whole_1k = rss_slopes(samples)
    return {
        "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
        "duration_s": round(elapsed, 1), "clients": args.clients, "texts_per_request": args.texts,
        "server_env": dict(args.server_env), "tracemalloc": args.tracemalloc,
        "requests_ok": load.ok, "requests_failed": load.failed,
        "requests_per_s": round(load.ok / elapsed, 2) if elapsed else None,
        # CPU time rather than throughput compares the allocator settings on a shared machine.
        "server_cpu_ms_per_request": round(cpu_s * 1e3 / load.ok, 1) if load.ok else None,
        "rss_mb": {"start": round(rss[0] / 1e6, 1), "at_one_third": round(_at(samples, args.duration / 3) / 1e6, 1),
                   "at_two_thirds": round(_at(samples, args.duration * 2 / 3) / 1e6, 1),
                   "end": round(rss[-1] / 1e6, 1), "max": round(max(rss) / 1e6, 1)},
        "slope_last_third_mb_per_min": _round(per_min), "slope_last_third_mb_per_1k_requests": _round(per_1k),
        "slope_whole_run_mb_per_min": _round(whole_min), "slope_whole_run_mb_per_1k_requests": _round(whole_1k),
        "malloc_trims": guard.get("malloc_trims") if guard else None,
        "malloc_trim_seconds": guard.get("malloc_trim_seconds") if guard else None,
        "heap_at_one_third": heap_early, "heap_end": heap_end,
        "samples": [(round(t, 1), round(r / 1e6, 1), n) for t, r, n in samples], "logs": str(log_dir),
    }


def _at(samples: list[tuple[float, int, int]], when: float) -> int:
    return min(samples, key=lambda s: abs(s[0] - when))[1]


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def render(r: dict[str, Any]) -> str:
    rss = r["rss_mb"]
    lines = [
        f"soak: {r['duration_s']} s, {r['clients']} clients x {r['texts_per_request']} texts, "
        f"env {r['server_env'] or '-'}, tracemalloc {'on' if r['tracemalloc'] else 'off'}",
        f"requests: {r['requests_ok']} ok ({r['requests_per_s']}/s, server CPU "
        f"{r['server_cpu_ms_per_request']} ms each), failed {r['requests_failed'] or 0}; "
        f"heap trims {r['malloc_trims']} taking {r['malloc_trim_seconds']} s in all",
        f"RSS MB: start {rss['start']}, 1/3 {rss['at_one_third']}, 2/3 {rss['at_two_thirds']}, "
        f"end {rss['end']}, max {rss['max']}",
        f"RSS slope, last third: {r['slope_last_third_mb_per_min']} MB/min, "
        f"{r['slope_last_third_mb_per_1k_requests']} MB per 1k requests "
        f"(whole run {r['slope_whole_run_mb_per_min']} MB/min, {r['slope_whole_run_mb_per_1k_requests']} MB/1k)",
    ]
    h0, h1 = r.get("heap_at_one_third"), r.get("heap_end")
    if h0 and h1:
        lines.append(f"traced Python heap MB: {h0['traced_bytes'] / 1e6:.1f} at 1/3 -> "
                     f"{h1['traced_bytes'] / 1e6:.1f} at the end")
        before = {s["site"]: s["size_bytes"] for s in h0["top"]}
        grown = sorted(((s["size_bytes"] - before[s["site"]], s["site"]) for s in h1["top"] if s["site"] in before),
                       reverse=True)[:3]
        lines.append("largest growth among the top sites: " + "; ".join(
            f"{site} {delta / 1e6:+.2f} MB" for delta, site in grown))
    if h1:
        lines.append("heap top-10 at the end (size, count, site):")
        lines += [f"  {s['size_bytes'] / 1e6:8.2f} MB {s['count']:>8}  {s['site']}" for s in h1["top"]]
    return "\n".join(lines)


def _env_pair(s: str) -> tuple[str, str]:
    name, sep, value = s.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {s!r}")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--texts", type=int, default=4, help="texts per request")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--corpus", type=int, default=5000, help="distinct texts to draw from")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model", type=Path, help="model folder (default: the packaged MiniLM)")
    p.add_argument("--torch-threads", type=int)
    p.add_argument("--server-env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace the server's Python heap (PYTHONTRACEMALLOC=1) and report its top-10 sites; "
                   "a diagnosis run: tracing slows the server and its snapshots cost memory")
    p.add_argument("--logs", help="folder for the server's log (default: a new temporary one)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["requests_ok"] and not result["requests_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
