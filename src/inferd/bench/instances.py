"""The instances phase of ``inferd bench``: one model on one instance with every thread, or on several instances of
one thread each (core/instances.py), through the server at one and at many concurrent clients, per backend.

Each round serves every arrangement of every backend in an order rotated per round, and the ratios (instances of
one thread / one instance of every thread) are taken within a round: the same minutes of a noisy machine. The
default of ``model.instances`` follows what this measures (bench/RESULTS.md, "Instances").
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.bench.backends_report import why_failed
from inferd.bench.load import Target, TextSource, _phase, _run, closed_loop
from inferd.bench.procs import ServerFailed, start_inferd

# The first start of a converted backend exports the model and runs the accuracy gate (minutes on a busy CPU).
FIRST_START_S = 900.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances-backends", default="torch,openvino",
                   help="instances phase: backends to compare on (torch,openvino)")
    p.add_argument("--instances-concurrency", default="1,32",
                   help="instances phase: closed-loop clients, one text per request (1,32)")
    p.add_argument("--instances-rounds", type=int, default=2,
                   help="instances phase: rounds over the arrangements, order rotated per round (2)")


def arrangements(threads: int) -> list[tuple[str, int, int]]:
    """(name, instances, threads each): one instance of every thread, and one instance per thread."""
    return [(f"1x{threads}", 1, threads), (f"{threads}x1", threads, 1)]


def _measure(url: str, source: TextSource, users: int, args: argparse.Namespace) -> dict[str, Any]:
    target = Target(url, "/v1/embeddings", "input", args.client)

    def loop(seconds: float) -> Callable[..., Any]:
        return lambda c: closed_loop(c, target, source, users, 1, seconds)

    warm = loop(args.warmup) if args.warmup > 0 else None
    result = _run(_phase(target, loop(args.duration), warm, users))
    return {"texts_per_s": result["texts_per_s"], "p50_ms": result.get("p50_ms"), "p99_ms": result.get("p99_ms"),
            "errors": result.get("errors") or {}}


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def run_phase(args: argparse.Namespace, model: Path, source: TextSource, say: Callable[[str], None],
              logs: Path) -> dict[str, Any]:
    import os

    threads = args.torch_threads or os.cpu_count() or 2
    backends = [b.strip() for b in args.instances_backends.split(",") if b.strip()]
    clients = [int(c) for c in args.instances_concurrency.split(",") if c.strip()]
    shapes = arrangements(threads)
    rounds: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    started: set[str] = set()
    for r in range(args.instances_rounds):
        row: dict[str, Any] = {"round": r}
        order = [(b, s) for b in backends for s in shapes]
        for backend, (name, instances, each) in order[r % len(order):] + order[:r % len(order)]:
            env = {"INFERD__MODEL__DEVICE": args.device, "INFERD__MODEL__BACKEND": backend,
                   "INFERD__MODEL__INSTANCES": str(instances), "INFERD__MODEL__THREADS": str(each),
                   "INFERD__MODEL__EXIT_ON_LOAD_FAILURE": "true", **dict(args.server_env)}
            try:
                server = start_inferd(logs, model, threads, env, name=f"instances-{backend}-{name}",
                                      timeout=180.0 if backend in started else FIRST_START_S)
            except (ServerFailed, OSError) as exc:
                errors.append({"round": r, "backend": backend, "arrangement": name,
                               "error": why_failed(str(exc)[-6000:])})
                say(f"instances: round {r + 1}: {backend} {name}: {errors[-1]['error']}")
                continue
            started.add(backend)
            try:
                for users in clients:
                    f = _measure(server.url, source, users, args)
                    row.setdefault(backend, {}).setdefault(str(users), {})[name] = f
                    say(f"instances: round {r + 1}: {backend} {name} at {users} client(s): {f['texts_per_s']:.1f} "
                        f"texts/s, P50 {f['p50_ms']} ms, P99 {f['p99_ms']} ms")
            finally:
                server.stop()
        rounds.append(row)
    summary = summarise(rounds, backends, clients, [s[0] for s in shapes])
    first = next(iter(summary.values()), {})
    return {"threads": threads, "arrangements": [s[0] for s in shapes], "clients": clients, "backends": backends,
            "rounds": rounds, "summary": summary, "round_errors": errors,
            # the run's one-line figure (_line): one thread per instance, the first backend at its first count
            "texts_per_s": (first.get(shapes[1][0], {}).get("texts_per_s") or {}).get("median") or 0.0}


FIGURES = ("texts_per_s", "p50_ms", "p99_ms")


def summarise(rounds: list[dict[str, Any]], backends: list[str], clients: list[int],
              names: list[str]) -> dict[str, Any]:
    """Per backend and client count: each arrangement's figures over the rounds, and per round the ratio of the
    second arrangement (one thread each) to the first (one instance)."""
    out: dict[str, Any] = {}
    for backend in backends:
        for users in clients:
            cells = [r.get(backend, {}).get(str(users), {}) for r in rounds]
            entry: dict[str, Any] = {}
            for name in names:
                entry[name] = {f: _spread([c[name][f] for c in cells if name in c and c[name].get(f) is not None])
                               for f in FIGURES}
            entry["ratio"] = {f: _spread([round(c[names[1]][f] / c[names[0]][f], 3) for c in cells
                                          if names[0] in c and names[1] in c and c[names[0]].get(f)
                                          and c[names[1]].get(f) is not None]) for f in FIGURES}
            out[f"{backend} @ {users}"] = entry
    return out


def instances_markdown(phase: dict[str, Any]) -> str:
    first, second = phase["arrangements"]
    lines = [f"Instances: one model, {first} (one instance of every thread) vs {second} (one thread each), "
             f"closed loop of one-text embeddings; {len(phase['rounds'])} round(s), median (min-max)", "",
             f"| backend @ clients | {first} texts/s | {second} texts/s | {second} / {first} texts/s | "
             f"{first} P99 ms | {second} P99 ms | {second} / {first} P99 |", "|---|---|---|---|---|---|---|"]

    def cell(d: dict[str, Any]) -> str:
        return "-" if d["median"] is None else f"{d['median']:g} ({d['min']:g}-{d['max']:g})"

    for key, entry in phase["summary"].items():
        lines.append(f"| {key} | {cell(entry[first]['texts_per_s'])} | {cell(entry[second]['texts_per_s'])} | "
                     f"{cell(entry['ratio']['texts_per_s'])} | {cell(entry[first]['p99_ms'])} | "
                     f"{cell(entry[second]['p99_ms'])} | {cell(entry['ratio']['p99_ms'])} |")
    return "\n".join(lines) + "\n"
