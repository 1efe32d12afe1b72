"""The fleet phase of ``inferd bench``: the same closed-loop load through nginx on 1 and 2 workers, against one
plain process, and what nginx adds to a request at concurrency 1.

Two real fleets (``inferd fleet``: supervisord, nginx, ``inferd serve`` workers), one after the other:

- 1 worker with every torch thread: ``direct@1`` and ``nginx@1`` (concurrency 1, straight to the worker and
  through nginx: the difference of their P50s is nginx's overhead per request), ``plain@C`` (concurrency C
  straight to the worker: one plain ``inferd serve`` process) and ``fleet1@C`` (the same through nginx);
- 2 workers, the threads split between them: ``fleet2@C`` through nginx.

Opt-in (``--phases fleet``): it needs nginx, and takes two fleet start-ups plus five phases.
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
from inferd.bench.procs import ROOT, ServerFailed, _base_env, free_port
from inferd.bench.stats import ratio

Guarded = Callable[..., dict[str, Any] | None]


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


# Concurrency-1 slices, alternating straight-to-the-worker and through-nginx, for nginx's overhead: on a shared
# machine the load drifts over a run, and pairing neighbouring slices cancels most of that drift.
OVERHEAD_ROUNDS = 4


def _combine(slices: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase from several slices: summed counts, the median of the slices' percentiles."""
    texts = sum(s["texts"] for s in slices)
    elapsed = sum(s["elapsed_s"] for s in slices)
    errors: dict[str, int] = {}
    for s in slices:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    out: dict[str, Any] = {"texts": texts, "ok_requests": sum(s["ok_requests"] for s in slices),
                           "requests": sum(s["requests"] for s in slices), "errors": errors,
                           "elapsed_s": round(elapsed, 3), "texts_per_s": round(texts / elapsed, 2) if elapsed else 0.0,
                           "concurrency": 1, "texts_per_request": 1, "slices": len(slices),
                           "slice_p50_ms": [s["p50_ms"] for s in slices]}
    for key in ("p50_ms", "p90_ms", "p99_ms"):
        values = [s[key] for s in slices if s[key] is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    return out


def fleet_phases(args: argparse.Namespace, model: Path, source: TextSource, phases: dict[str, Any],
                 guarded: Guarded, say: Callable[[str], None], logs: Path) -> None:
    """Run the fleet phases into ``phases`` (names fleet:...); a fleet that cannot start fails its phases."""
    from inferd.fleet.layout import usable_cores

    threads = args.torch_threads or usable_cores()
    c, extra = args.fleet_concurrency, dict(args.server_env)

    def closed(url: str, concurrency: int, duration: float, warmup: float) -> dict[str, Any]:
        return run_closed(Target(url, client=args.client), source, concurrency, 1, duration, warmup)

    def load(name: str, url: str, concurrency: int, **meta: Any) -> None:
        say(f"{name}: closed loop, concurrency {concurrency}, 1 text/request, {args.duration:g} s")
        guarded(phases, name, say, lambda: closed(url, concurrency, args.duration, args.warmup),
                kind="fleet", server="fleet", **meta)

    def overhead(direct: str, proxied: str, meta: dict[str, Any]) -> dict[str, Any]:
        per = args.duration / OVERHEAD_ROUNDS
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "nginx": []}
        for i in range(OVERHEAD_ROUNDS):
            for via in ("direct", "nginx") if i % 2 == 0 else ("nginx", "direct"):
                runs[via].append(closed(direct if via == "direct" else proxied, 1, per, min(args.warmup, 0.5)))
        phases["fleet:direct@1"] = {**meta, "kind": "fleet", "server": "fleet", "via": "direct",
                                    **_combine(runs["direct"])}
        say(f"fleet:direct@1: P50 {phases['fleet:direct@1']['p50_ms']} ms (median of {OVERHEAD_ROUNDS} slices)")
        paired = [round(n["p50_ms"] - d["p50_ms"], 3) for d, n in zip(runs["direct"], runs["nginx"], strict=True)
                  if n["p50_ms"] is not None and d["p50_ms"] is not None]
        return {**_combine(runs["nginx"]), "paired_overhead_ms": paired}

    for workers in (1, 2):
        each = max(1, threads // workers)
        say(f"starting inferd fleet: {workers} worker(s), {each} torch thread(s) each")
        try:
            fleet = start_fleet(logs, model, workers, each, extra)
        except ServerFailed as exc:
            phases[f"fleet:{workers}w"] = {"kind": "fleet", "server": "fleet", "error": str(exc)[:2000]}
            say(f"fleet of {workers} failed to start: {str(exc)[:300]}")
            continue
        try:
            meta = {"workers": workers, "torch_threads": each, "logs": str(fleet.keep)}
            if workers == 1:
                direct = f"http://127.0.0.1:{fleet.workers[0]['port']}"
                say(f"fleet:direct@1 / fleet:nginx@1: concurrency 1, {OVERHEAD_ROUNDS} alternating slices each, "
                    f"{args.duration:g} s in all per side")
                guarded(phases, "fleet:nginx@1", say, lambda d=direct, u=fleet.url, m=meta: overhead(d, u, m),
                        kind="fleet", server="fleet", via="nginx", **meta)
                load(f"fleet:plain@{c}", direct, c, via="direct", **meta)
                load(f"fleet:fleet1@{c}", fleet.url, c, via="nginx", **meta)
            else:
                load(f"fleet:fleet2@{c}", fleet.url, c, via="nginx", **meta)
        finally:
            fleet.stop()


def fleet_summary(phases: dict[str, Any], concurrency: int) -> dict[str, float | None]:
    """The ratios the fleet phase is for, from the phases it ran (None where one is missing)."""
    def get(name: str, key: str) -> float | None:
        p = phases.get(f"fleet:{name}") or {}
        return None if p.get("error") else p.get(key)

    c = concurrency
    direct = get("direct@1", "p50_ms")
    paired = (phases.get("fleet:nginx@1") or {}).get("paired_overhead_ms") or []
    return {
        "fleet2_over_plain": ratio(get(f"fleet2@{c}", "texts_per_s"), get(f"plain@{c}", "texts_per_s")),
        "fleet1_over_plain": ratio(get(f"fleet1@{c}", "texts_per_s"), get(f"plain@{c}", "texts_per_s")),
        "fleet2_over_fleet1": ratio(get(f"fleet2@{c}", "texts_per_s"), get(f"fleet1@{c}", "texts_per_s")),
        # The median over neighbouring slices of (P50 through nginx − P50 direct), and their range.
        "nginx_overhead_p50_ms": round(statistics.median(paired), 3) if paired else None,
        "nginx_overhead_range_ms": [min(paired), max(paired)] if paired else None,
        "direct_p50_ms_at_1": direct,
    }


def _fmt(v: Any, digits: int = 1) -> str:
    return "–" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def fleet_markdown(results: dict[str, Any]) -> str:
    """The fleet section of RESULTS.md (empty when the fleet phase did not run)."""
    phases = {n: p for n, p in results["phases"].items() if n.startswith("fleet:")}
    if not phases:
        return ""
    summary = results.get("fleet") or {}
    out = ["## Fleet: nginx + supervisord, 1 and 2 workers, against one plain process", "",
           "| phase | workers | torch threads each | via | concurrency | texts/s | P50 ms | P90 ms | P99 ms | errors |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in phases.items():
        if p.get("error"):
            continue
        errors = sum(p["errors"].values()) if isinstance(p.get("errors"), dict) else p.get("errors")
        out.append(f"| {name.removeprefix('fleet:')} | {p['workers']} | {p['torch_threads']} | {p['via']} | "
                   f"{p['concurrency']} | {_fmt(p['texts_per_s'])} | {_fmt(p['p50_ms'])} | {_fmt(p['p90_ms'])} | "
                   f"{_fmt(p['p99_ms'])} | {errors} |")
    out += ["", f"- 2 workers through nginx / one plain process: **{_fmt(summary.get('fleet2_over_plain'), 3)}**; "
            f"1 worker through nginx / the same process direct: {_fmt(summary.get('fleet1_over_plain'), 3)}; "
            f"2 workers / 1 worker, both through nginx: {_fmt(summary.get('fleet2_over_fleet1'), 3)}.",
            f"- nginx's overhead at concurrency 1 (P50 through nginx − P50 direct, same worker, median of "
            f"{OVERHEAD_ROUNDS} pairs of neighbouring slices): **{_fmt(summary.get('nginx_overhead_p50_ms'), 2)} ms** "
            f"(pairs ranged {summary.get('nginx_overhead_range_ms')} ms) on a direct P50 of "
            f"{_fmt(summary.get('direct_p50_ms_at_1'), 2)} ms.", ""]
    failed = [n for n, p in phases.items() if p.get("error")]
    out += [f"- failed: {n}: {phases[n]['error'][:300]}" for n in failed]
    return "\n".join(out) + "\n"
