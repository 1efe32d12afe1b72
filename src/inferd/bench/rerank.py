"""The rerank phase of ``inferd bench``: a cross-encoder served by ``inferd serve``, one query and 32 documents
per request on /v1/rerank, closed loop. It reports pairs/s (each document is one pair, one batch item) beside
the embedding phases' texts/s: a pair costs a query's tokens more than a text, so the two are not one figure.

With ``--rerank-backends`` (say ``torch,openvino:bfloat16,openvino:int8``) every configuration is served in
turn, and with ``--infinity`` infinity's ``/rerank`` (``infinity_emb v2 --engine torch`` on the same folder)
beside them: each configuration first starts cold (export and score gate into a fresh cache; a configuration
the gate refuses is reported with its reason, not measured), then ``--rerank-rounds`` rounds each serve every
configuration once, in an order rotated per round, and ratios are taken within a round (the same minutes of
a noisy machine's load). The first configuration is the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inferd.bench.backends import Config, parse_configs
from inferd.bench.backends_report import why_failed
from inferd.bench.infinity import start_infinity
from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.procs import ServerFailed, ServerProc, Starts, start_inferd

DOCUMENTS_PER_REQUEST = 32
QUERY = "which of these passages answers the question about the river and the city"
# The targets, pairs/s within each round: (configuration, compared with, at least).
TARGETS = (("openvino bf16", "torch fp32", 2.0), ("openvino bf16", "infinity torch", 3.0))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rerank-model", type=Path,
                   help="rerank phase: a cross-encoder folder (BertForSequenceClassification, one label); "
                        "without it the phase is skipped")
    p.add_argument("--rerank-concurrency", type=int, default=8, help="rerank phase: closed-loop users (8)")
    p.add_argument("--rerank-backends", type=parse_configs, default=None, metavar="CONFIGS",
                   help="rerank phase: backend configurations served side by side, e.g. "
                        "torch,openvino:bfloat16,openvino:int8 (default: the server's own settings only)")
    p.add_argument("--rerank-rounds", type=int, default=1,
                   help="rerank phase: rounds over the configurations, order rotated per round (1)")


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 2), "min": round(min(vals), 2), "max": round(max(vals), 2)}


def _ratios(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[float]:
    by_round = {x["round"]: x["pairs_per_s"] for x in theirs}
    return [round(x["pairs_per_s"] / by_round[x["round"]], 3) for x in mine if by_round.get(x["round"])]


def summarise(rows: dict[str, dict[str, Any]], baseline: str) -> dict[str, Any]:
    """Median and range of pairs/s per configuration; ratios to the baseline and to infinity, round by round;
    the targets met or not."""
    for row in rows.values():
        row["pairs_per_s"] = _spread([x["pairs_per_s"] for x in row["rounds"]])
        row["p99_ms"] = _spread([x.get("p99_ms") for x in row["rounds"]])
        base = rows.get(baseline, {}).get("rounds", [])
        row["ratio"] = _spread(_ratios(row["rounds"], base)) if base else _spread([])
        row["versus"] = {name: _ratios(row["rounds"], other["rounds"]) for name, other in rows.items()
                         if name.startswith("infinity") and other["rounds"]}
    met = []
    for name, other, least in TARGETS:
        if name in rows and other in rows and rows[name]["rounds"] and rows[other]["rounds"]:
            ratios = _ratios(rows[name]["rounds"], rows[other]["rounds"])
            median = statistics.median(ratios) if ratios else None
            met.append({"configuration": name, "versus": other, "least": least, "ratios": ratios,
                        "median": median, "met": median is not None and median >= least})
    return {"baseline": baseline, "rows": rows, "targets": met}


def _base_env(args: argparse.Namespace) -> dict[str, str]:
    return {"INFERD__MODEL__DEVICE": args.device, "INFERD__MODEL__TASK": "rerank",
            "INFERD__MODEL__EXIT_ON_LOAD_FAILURE": "true", **dict(args.server_env)}


def start_ahead(args: argparse.Namespace, logs: Path, starts: Starts) -> None:
    """Start the phase's one server ahead (``--quick``), when it has one: the server's own settings, nothing to
    alternate with (no --rerank-backends, no --infinity). Its cold start is then not timed, which that case
    never reports (``cold_start_s`` is shown beside other configurations only)."""
    if args.rerank_backends is None and getattr(args, "infinity", None) is None:
        model = args.rerank_model.resolve()
        starts.ahead("rerank", lambda: start_inferd(logs, model, args.torch_threads, _base_env(args), timeout=1800))


def run_phase(args: argparse.Namespace, source: TextSource, say: Callable[[str], None],
              logs: Path, starts: Starts | None = None) -> dict[str, Any]:
    """The phase; the first configuration's first round is the phase's own figures (``pairs_per_s``...)."""
    model = args.rerank_model.resolve()
    configs: list[Config | None] = list(args.rerank_backends or [None])
    cache = Path(tempfile.mkdtemp(prefix="inferd-rerank-cache-", dir=logs))
    base = _base_env(args)

    def name_of(c: Config | None) -> str:
        return "server settings" if c is None else c.name

    def env_of(c: Config | None) -> dict[str, str]:
        return {**base, **({} if c is None else c.env(cache))}

    rows: dict[str, dict[str, Any]] = {name_of(c): {"rounds": []} for c in configs}
    servers: list[tuple[str, Callable[[], ServerProc], Target]] = []
    kept: ServerProc | None = None
    for c in configs:  # cold starts: each export and score gate, timed as a server start
        name = name_of(c)
        say(f"rerank: {name}: cold start on the cross-encoder {model}")

        def cold(c: Config | None = c) -> ServerProc:
            return start_inferd(logs, model, args.torch_threads, env_of(c), timeout=1800)

        t0 = time.monotonic()
        try:
            server = starts.take("rerank", cold) if starts is not None and c is None else cold()
        except ServerFailed as exc:
            rows[name]["error"] = why_failed(str(exc)[-6000:])
            say(f"rerank: {name}: {rows[name]['error']}")
            continue
        rows[name]["cold_start_s"] = round(time.monotonic() - t0, 2)
        if len(configs) == 1 and getattr(args, "infinity", None) is None:
            kept = server  # nothing to alternate with: the cold-started server serves the first round
        else:
            server.stop()
        servers.append((name, lambda c=c: start_inferd(logs, model, args.torch_threads, env_of(c), timeout=600),
                        Target("", path="/v1/rerank", field_name="documents", client=args.client, query=QUERY)))
    if getattr(args, "infinity", None) is not None:
        rows["infinity torch"] = {"rounds": []}
        servers.append(("infinity torch", lambda: start_infinity(args.infinity, "torch", model, logs,
                                                                  args.torch_threads),
                        Target("", path="/rerank", field_name="documents", client=args.client, query=QUERY,
                               extra={"model": "model"})))
    c = args.rerank_concurrency
    for r in range(args.rerank_rounds):
        for name, start, target in servers[r % len(servers):] + servers[:r % len(servers)]:
            try:
                server, kept = (kept, None) if kept is not None else (start(), None)
            except (ServerFailed, OSError) as exc:
                # A round lost is recorded, the rounds measured still count.
                rows[name].setdefault("round_errors", []).append({"round": r, "error": why_failed(str(exc)[-6000:])})
                say(f"rerank: {name}: round {r + 1}: {rows[name]['round_errors'][-1]['error']}")
                continue
            try:
                say(f"rerank@{c}x{DOCUMENTS_PER_REQUEST} round {r + 1}: {name}, closed loop, {args.duration:g} s")
                result = run_closed(Target(server.url, target.path, target.field, target.client, target.query,
                                           target.extra), source, c, DOCUMENTS_PER_REQUEST, args.duration,
                                    args.warmup)
            finally:
                server.stop()
            # Each document sent is one (query, document) pair: the load generator's "texts" are pairs here.
            result["pairs_per_s"] = result["texts_per_s"]
            result["documents_per_request"] = DOCUMENTS_PER_REQUEST
            rows[name]["rounds"].append({"round": r, **result})
            say(f"rerank: round {r + 1}: {name} {result['pairs_per_s']:.1f} pairs/s, P99 {result.get('p99_ms')} ms, "
                f"errors {result.get('errors') or 0}")
    first = rows[name_of(configs[0])]
    if not first["rounds"]:
        raise RuntimeError(f"rerank: the baseline {name_of(configs[0])} was not measured: "
                           f"{first.get('error', 'no round')[-400:]}")
    out = dict(first["rounds"][0])
    if len(rows) > 1:
        out["backends"] = summarise(rows, name_of(configs[0]))
    return out
