"""The fleet phase of ``inferd bench``: the same closed-loop load through nginx on 1 and 2 workers, against one
plain process, and what nginx adds to a request at concurrency 1.

Two real fleets (``inferd fleet``: supervisord, nginx, ``inferd serve`` workers) run side by side, idle but for
the slice being measured: one of 1 worker with every torch thread, one of 2 workers splitting the threads. The
phases, at concurrency C, one text per request:

- ``plain@C``: straight to the 1-worker fleet's worker: one plain ``inferd serve`` process;
- ``fleet1@C``: the same worker through its nginx;  ``fleet2@C``: the 2 workers through theirs;
- ``direct@1`` and ``nginx@1``: concurrency 1 straight to that worker and through nginx; the difference of their
  P50s is nginx's overhead per request.

On a shared machine the load drifts during a run, so each phase is cut into ROUNDS slices and the phases take
turns (the order rotating each round); a phase's figures are its slices' totals (texts/s) and the median of their
percentiles, and each ratio is also given per round, to show its spread. Opt-in (``--phases fleet``): it needs
nginx and two fleets.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.procs import ROOT, ServerFailed, _base_env, free_port, start_together, stop_together
from inferd.bench.stats import ratio


@dataclass
class FleetProc:
    proc: subprocess.Popen[bytes]
    url: str
    run_dir: Path
    log_path: Path
    keep: Path  # where the run folder is copied when the fleet stops (under the benchmark's --logs)

    @property
    def workers(self) -> list[dict[str, Any]]:
        return json.loads((self.run_dir / "layout.json").read_text())["workers"]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 120.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # Its supervisord gets SIGTERM when it dies (PR_SET_PDEATHSIG) and stops the workers.
                self.proc.kill()
                self.proc.wait(10)
        # The logs and rendered files join the other servers' logs; the temp folder goes.
        shutil.copytree(self.run_dir, self.keep, ignore=shutil.ignore_patterns("nginx", "*.sock"),
                        dirs_exist_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def start_fleet(log_dir: Path, model: Path, workers: int, threads: int, extra_env: dict[str, str],
                timeout: float = 300.0) -> FleetProc:
    """``inferd fleet`` (prod overlay, quiet logs) with ``workers`` workers of ``threads`` torch threads each."""
    port = free_port()
    # In the temp folder, not under log_dir: a deep folder would pass the unix socket path limit of supervisord's
    # socket. Its logs stay there (its path is in results.json).
    run_dir = Path(tempfile.mkdtemp(prefix=f"inferd-fleet-{workers}w-"))
    env = _base_env(None)
    env.update({"INFERD_ENV": "prod", "INFERD__SERVER__LOG_LEVEL": "WARNING", "INFERD__MODEL__PATH": str(model),
                "INFERD__RUNTIME__TORCH_THREADS": str(threads)})
    if (ROOT / "configs" / "base.yaml").is_file():
        env["INFERD_CONFIG_DIR"] = str(ROOT / "configs")
    env.update(extra_env)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"fleet-{workers}w-{port}.log"
    cmd = [sys.executable, "-m", "inferd.cli", "fleet", "--workers", str(workers), "--port", str(port),
           "--run-dir", str(run_dir)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir,
                                start_new_session=True)
    fleet = FleetProc(proc, f"http://127.0.0.1:{port}", run_dir, log_path, log_dir / f"fleet-{workers}w-{port}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"inferd fleet exited with {proc.returncode}:\n{fleet.log_tail()}")
        try:
            health = httpx.get(fleet.url + "/health/fleet", timeout=2.0).json()
            if health.get("ready") == workers:
                return fleet
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    fleet.stop()
    raise ServerFailed(f"the fleet of {workers} was not ready after {timeout:.0f}s:\n{fleet.log_tail()}")


# Slices per phase: each phase's time is cut into this many turns, taken in rotating order.
ROUNDS = 4


def _combine(slices: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """One phase from its slices: summed counts, the median of the slices' percentiles."""
    texts = sum(s["texts"] for s in slices)
    elapsed = sum(s["elapsed_s"] for s in slices)
    errors: dict[str, int] = {}
    for s in slices:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    out: dict[str, Any] = {"texts": texts, "ok_requests": sum(s["ok_requests"] for s in slices),
                           "requests": sum(s["requests"] for s in slices), "errors": errors,
                           "elapsed_s": round(elapsed, 3), "texts_per_s": round(texts / elapsed, 2) if elapsed else 0.0,
                           "concurrency": concurrency, "texts_per_request": 1, "slices": len(slices),
                           "slice_texts_per_s": [s["texts_per_s"] for s in slices],
                           "slice_p50_ms": [s["p50_ms"] for s in slices]}
    for key in ("p50_ms", "p90_ms", "p99_ms", "mean_batch_size", "worker_busy"):
        # Batch figures only where /metrics was scraped (straight to a worker; nginx answers it 404).
        values = [s[key] for s in slices if s.get(key) is not None]
        out[key] = round(statistics.median(values), 3 if key == "worker_busy" else 2) if values else None
    return out


def fleet_phases(args: argparse.Namespace, model: Path, source: TextSource, phases: dict[str, Any],
                 say: Callable[[str], None], logs: Path) -> None:
    """Run the fleet phases into ``phases`` (names fleet:...); a fleet that cannot start fails the phase."""
    from inferd.fleet.layout import usable_cores

    threads = args.torch_threads or usable_cores()
    c, extra = args.fleet_concurrency, dict(args.server_env)
    each = {workers: max(1, threads // workers) for workers in (1, 2)}
    for workers in (1, 2):
        say(f"starting inferd fleet: {workers} worker(s), {each[workers]} torch thread(s) each")
    try:
        # At once: both are up side by side for the whole phase anyway, and nothing is measured before both are.
        one, two = start_together([lambda: start_fleet(logs, model, 1, each[1], extra),
                                   lambda: start_fleet(logs, model, 2, each[2], extra)])
    except ServerFailed as exc:
        phases["fleet"] = {"kind": "fleet", "server": "fleet", "error": str(exc)[:2000]}
        say(f"a fleet failed to start: {str(exc)[:300]}")
        return
    try:
        direct = f"http://127.0.0.1:{one.workers[0]['port']}"
        meta = {
            f"plain@{c}": (direct, c, {"workers": 1, "via": "direct", "logs": str(one.keep)}),
            f"fleet1@{c}": (one.url, c, {"workers": 1, "via": "nginx", "logs": str(one.keep)}),
            f"fleet2@{c}": (two.url, c, {"workers": 2, "via": "nginx", "logs": str(two.keep)}),
            "direct@1": (direct, 1, {"workers": 1, "via": "direct", "logs": str(one.keep)}),
            "nginx@1": (one.url, 1, {"workers": 1, "via": "nginx", "logs": str(one.keep)}),
        }
        say(f"fleet: {', '.join(meta)}: {ROUNDS} turns each of {args.duration / ROUNDS:g} s, in rotating order")
        try:
            _rounds(args, source, meta, threads, phases, say)
        except (ServerFailed, OSError, RuntimeError) as exc:
            phases["fleet"] = {"kind": "fleet", "server": "fleet", "error": f"{type(exc).__name__}: {exc}"[:2000]}
            say(f"fleet: FAILED: {phases['fleet']['error'][:300]}")
    finally:
        stop_together([one, two])


def _rounds(args: argparse.Namespace, source: TextSource, meta: dict[str, tuple[str, int, dict[str, Any]]],
            threads: int, phases: dict[str, Any], say: Callable[[str], None]) -> None:
    """Every phase's slices, taking turns, into ``phases``, with the ratios of each round."""
    names = list(meta)
    slices: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(ROUNDS):
        for name in names[i % len(names):] + names[:i % len(names)]:
            url, concurrency, _ = meta[name]
            slices[name].append(run_closed(Target(url, client=args.client), source, concurrency, 1,
                                           args.duration / ROUNDS, min(args.warmup, 1.0)))
        say(f"fleet round {i + 1}/{ROUNDS}: " + ", ".join(f"{n} {slices[n][-1]['texts_per_s']:.1f} texts/s"
                                                          for n in names))
    for name, (_, concurrency, info) in meta.items():
        phases[f"fleet:{name}"] = {"kind": "fleet", "server": "fleet", **info,
                                   "torch_threads": max(1, threads // info["workers"]),
                                   **_combine(slices[name], concurrency)}
    c = meta[names[0]][1]

    def per_round(a: str, b: str, key: str, diff: bool = False) -> list[float]:
        out = []
        for x, y in zip(slices[a], slices[b], strict=True):
            if x[key] is not None and y[key]:
                out.append(round(x[key] - y[key], 3) if diff else round(x[key] / y[key], 3))
        return out

    phases[f"fleet:fleet2@{c}"]["round_over_plain"] = per_round(f"fleet2@{c}", f"plain@{c}", "texts_per_s")
    phases[f"fleet:fleet1@{c}"]["round_over_plain"] = per_round(f"fleet1@{c}", f"plain@{c}", "texts_per_s")
    phases["fleet:nginx@1"]["round_overhead_ms"] = per_round("nginx@1", "direct@1", "p50_ms", diff=True)
    for name in names:
        p = phases[f"fleet:{name}"]
        say(f"fleet:{name}: {p['texts_per_s']:.1f} texts/s, P50 {p['p50_ms']} ms (median of the turns)")


def fleet_summary(phases: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """The ratios the fleet phase is for, over the whole phase and per round (None where one is missing)."""
    def get(name: str, key: str) -> float | None:
        p = phases.get(f"fleet:{name}") or {}
        return None if p.get("error") else p.get(key)

    c = concurrency

    def spread(name: str, key: str) -> list[float] | None:
        values = (phases.get(f"fleet:{name}") or {}).get(key) or []
        return [min(values), max(values)] if values else None

    overhead = (phases.get("fleet:nginx@1") or {}).get("round_overhead_ms") or []
    return {
        "fleet2_over_plain": ratio(get(f"fleet2@{c}", "texts_per_s"), get(f"plain@{c}", "texts_per_s")),
        "fleet2_over_plain_rounds": spread(f"fleet2@{c}", "round_over_plain"),
        "fleet1_over_plain": ratio(get(f"fleet1@{c}", "texts_per_s"), get(f"plain@{c}", "texts_per_s")),
        "fleet1_over_plain_rounds": spread(f"fleet1@{c}", "round_over_plain"),
        "fleet2_over_fleet1": ratio(get(f"fleet2@{c}", "texts_per_s"), get(f"fleet1@{c}", "texts_per_s")),
        # The median over rounds of (P50 through nginx − P50 direct), and its range.
        "nginx_overhead_p50_ms": round(statistics.median(overhead), 3) if overhead else None,
        "nginx_overhead_rounds_ms": spread("nginx@1", "round_overhead_ms"),
        "direct_p50_ms_at_1": get("direct@1", "p50_ms"),
    }


def _fmt(v: Any, digits: int = 1) -> str:
    return "–" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def fleet_markdown(results: dict[str, Any]) -> str:
    """The fleet section of RESULTS.md (empty when the fleet phase did not run)."""
    phases = {n: p for n, p in results["phases"].items() if n.startswith("fleet")}
    if not phases:
        return ""
    summary = results.get("fleet") or {}
    out = ["## Fleet: nginx + supervisord, 1 and 2 workers, against one plain process", "",
           f"Each phase in {ROUNDS} turns, the phases taking turns in rotating order (both fleets up throughout).", "",
           "| phase | workers | torch threads each | via | concurrency | texts/s | texts/s per turn | P50 ms | P90 ms "
           "| P99 ms | mean batch | errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in phases.items():
        if p.get("error"):
            continue
        errors = sum(p["errors"].values()) if isinstance(p.get("errors"), dict) else p.get("errors")
        turns = ", ".join(f"{x:.1f}" for x in p.get("slice_texts_per_s", []))
        out.append(f"| {name.removeprefix('fleet:')} | {p['workers']} | {p['torch_threads']} | {p['via']} | "
                   f"{p['concurrency']} | {_fmt(p['texts_per_s'])} | {turns} | {_fmt(p['p50_ms'])} | "
                   f"{_fmt(p['p90_ms'])} | {_fmt(p['p99_ms'])} | {_fmt(p.get('mean_batch_size'))} | {errors} |")
    out += ["", f"- 2 workers through nginx / one plain process: **{_fmt(summary.get('fleet2_over_plain'), 3)}** "
            f"(per turn {summary.get('fleet2_over_plain_rounds')}); 1 worker through nginx / the same process direct: "
            f"{_fmt(summary.get('fleet1_over_plain'), 3)} (per turn {summary.get('fleet1_over_plain_rounds')}); "
            f"2 workers / 1 worker, both through nginx: {_fmt(summary.get('fleet2_over_fleet1'), 3)}.",
            f"- nginx's overhead at concurrency 1 (P50 through nginx − P50 direct, same worker, median over the "
            f"turns): **{_fmt(summary.get('nginx_overhead_p50_ms'), 2)} ms** (per turn "
            f"{summary.get('nginx_overhead_rounds_ms')} ms) on a direct P50 of "
            f"{_fmt(summary.get('direct_p50_ms_at_1'), 2)} ms.", ""]
    failed = [n for n, p in phases.items() if p.get("error")]
    out += [f"- failed: {n}: {phases[n]['error'][:300]}" for n in failed]
    return "\n".join(out) + "\n"
