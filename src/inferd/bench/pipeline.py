"""The pipeline phase of ``inferd bench``: a retrieval pipeline's mixed load, embeddings and reranks at once, on
one process serving both models (a ``models:`` list) against two single-model processes splitting the same cores.

Two closed loops run together on one client event loop: ``--pipeline-embed-concurrency`` users each sending
``--pipeline-embed-texts`` texts to /v1/embeddings, and ``--pipeline-rerank-concurrency`` users each sending one
query and 32 documents to /v1/rerank. "one process" serves the embedder (``--model``) and the reranker
(``--rerank-model``) with every compute thread; "two processes" run one model each with half the threads (so
together they use the same cores). Each round serves both arrangements, in an order rotated per round, and the
ratios (one process / two processes) are taken within a round: the same minutes of a noisy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from inferd.bench.backends_report import why_failed
from inferd.bench.load import Target, TextSource, _phase, _run, closed_loop
from inferd.bench.procs import ROOT, ServerFailed, ServerProc, start_inferd
from inferd.bench.rerank import DOCUMENTS_PER_REQUEST, QUERY

ARRANGEMENTS = ("one process", "two processes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline-embed-concurrency", type=int, default=8,
                   help="pipeline phase: closed-loop embedding users (8)")
    p.add_argument("--pipeline-embed-texts", type=int, default=1,
                   help="pipeline phase: texts per embedding request (1: a query's embedding)")
    p.add_argument("--pipeline-rerank-concurrency", type=int, default=4,
                   help=f"pipeline phase: closed-loop rerank users, 1 query + {DOCUMENTS_PER_REQUEST} documents (4)")
    p.add_argument("--pipeline-rounds", type=int, default=1,
                   help="pipeline phase: rounds over the two arrangements, order rotated per round (1)")


def _config_dir(logs: Path, embedder: Path, reranker: Path) -> Path:
    """base.yaml and a prod overlay serving both models (the bench's servers run INFERD_ENV=prod)."""
    logs.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="inferd-pipeline-config-", dir=logs))
    (folder / "base.yaml").write_text((ROOT / "configs" / "base.yaml").read_text(encoding="utf-8"))
    prod = yaml.safe_load((ROOT / "configs" / "prod.yaml").read_text(encoding="utf-8")) or {}
    prod["models"] = [{"name": "embedder", "path": str(embedder)},
                      {"name": "reranker", "path": str(reranker), "task": "rerank"}]
    (folder / "prod.yaml").write_text(yaml.safe_dump(prod, sort_keys=False), encoding="utf-8")
    return folder


def _both(embed: Target, rerank: Target, source: TextSource, args: argparse.Namespace) -> dict[str, Any]:
    """Both closed loops at once (one client event loop, so the two arrangements cost the client alike)."""
    import asyncio

    def loop(target: Target, users: int, per_request: int, seconds: float) -> Callable[..., Any]:
        return lambda c: closed_loop(c, target, source, users, per_request, seconds)

    ce, ke = args.pipeline_embed_concurrency, args.pipeline_embed_texts
    cr = args.pipeline_rerank_concurrency

    async def together() -> dict[str, Any]:
        warm = args.warmup if args.warmup > 0 else None
        embedded, reranked = await asyncio.gather(
            _phase(embed, loop(embed, ce, ke, args.duration), loop(embed, ce, ke, warm) if warm else None, ce),
            _phase(rerank, loop(rerank, cr, DOCUMENTS_PER_REQUEST, args.duration),
                   loop(rerank, cr, DOCUMENTS_PER_REQUEST, warm) if warm else None, cr))
        return {"embed": embedded, "rerank": reranked}

    return _run(together())


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    embed, rerank = result["embed"], result["rerank"]
    return {"embed_texts_per_s": embed["texts_per_s"], "embed_p50_ms": embed.get("p50_ms"),
            "embed_p99_ms": embed.get("p99_ms"), "embed_errors": embed.get("errors") or {},
            "rerank_pairs_per_s": rerank["texts_per_s"], "rerank_requests_per_s": rerank["requests_per_s"],
            "rerank_p50_ms": rerank.get("p50_ms"), "rerank_p99_ms": rerank.get("p99_ms"),
            "rerank_errors": rerank.get("errors") or {}}


FIGURES = ("embed_texts_per_s", "embed_p99_ms", "rerank_pairs_per_s", "rerank_p99_ms")


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arrangement, each figure's median and range over the rounds; per round, one process / two processes."""
    out: dict[str, Any] = {}
    for name in ARRANGEMENTS:
        rows = [r[name] for r in rounds if name in r]
        out[name] = {f: _spread([row[f] for row in rows]) for f in FIGURES}
    ratios: dict[str, list[float]] = {f: [] for f in FIGURES}
    for r in rounds:
        one, two = r.get(ARRANGEMENTS[0]), r.get(ARRANGEMENTS[1])
        if one and two:
            for f in FIGURES:
                if one.get(f) is not None and two.get(f):
                    ratios[f].append(round(one[f] / two[f], 3))
    out["one / two"] = {f: {"per_round": v, **_spread(v)} for f, v in ratios.items()}
    return out


def _spread(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3), "max": round(max(vals), 3)}


def run_phase(args: argparse.Namespace, embedder: Path, source: TextSource, say: Callable[[str], None],
              logs: Path) -> dict[str, Any]:
    reranker = args.rerank_model.resolve()
    threads = args.torch_threads or os.cpu_count() or 2
    half = max(1, threads // 2)
    base = {"INFERD__MODEL__DEVICE": args.device, "INFERD__MODEL__EXIT_ON_LOAD_FAILURE": "true",
            **dict(args.server_env)}
    config = _config_dir(logs, embedder, reranker)

    def one() -> list[ServerProc]:
        return [start_inferd(logs, None, threads, base, config_dir=config, name="pipeline")]

    def two() -> list[ServerProc]:
        first = start_inferd(logs, embedder, half, base, name="embedder")
        try:
            return [first, start_inferd(logs, reranker, max(1, threads - half),
                                        {**base, "INFERD__MODEL__TASK": "rerank"}, name="reranker")]
        except BaseException:
            first.stop()
            raise

    def targets(servers: list[ServerProc], named: bool) -> tuple[Target, Target]:
        e_url, r_url = servers[0].url, servers[-1].url
        return (Target(e_url, "/v1/embeddings", "input", args.client,
                       extra={"model": "embedder"} if named else None),
                Target(r_url, "/v1/rerank", "documents", args.client, query=QUERY,
                       extra={"model": "reranker"} if named else None))

    arrangements = [(ARRANGEMENTS[0], one, True), (ARRANGEMENTS[1], two, False)]
    rounds: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for r in range(args.pipeline_rounds):
        row: dict[str, Any] = {"round": r}
        for name, start, named in arrangements[r % 2:] + arrangements[:r % 2]:
            try:
                servers = start()
            except (ServerFailed, OSError) as exc:
                errors.append({"round": r, "arrangement": name, "error": why_failed(str(exc)[-6000:])})
                say(f"pipeline: round {r + 1}: {name}: {errors[-1]['error']}")
                continue
            try:
                say(f"pipeline round {r + 1}: {name}: embeddings x{args.pipeline_embed_concurrency} and reranks "
                    f"x{args.pipeline_rerank_concurrency} at once, {args.duration:g} s")
                row[name] = _figures(_both(*targets(servers, named), source, args))
            finally:
                for server in servers:
                    server.stop()
            f = row[name]
            say(f"pipeline: round {r + 1}: {name}: {f['embed_texts_per_s']:.1f} texts/s (P99 {f['embed_p99_ms']} ms), "
                f"{f['rerank_pairs_per_s']:.1f} pairs/s (P99 {f['rerank_p99_ms']} ms)")
        rounds.append(row)
    if not any(ARRANGEMENTS[0] in r for r in rounds):
        raise RuntimeError(f"pipeline: the one-process arrangement was not measured: {errors[-1:]}")
    return {"threads": threads, "threads_each_of_two": [half, max(1, threads - half)],
            "embed_concurrency": args.pipeline_embed_concurrency, "embed_texts": args.pipeline_embed_texts,
            "rerank_concurrency": args.pipeline_rerank_concurrency, "documents_per_request": DOCUMENTS_PER_REQUEST,
            "rounds": rounds, "summary": summarise(rounds), "round_errors": errors,
            # the run's one-line figure (_line): the one process's first round
            "texts_per_s": rounds[0].get(ARRANGEMENTS[0], {}).get("embed_texts_per_s"),
            "p99_ms": rounds[0].get(ARRANGEMENTS[0], {}).get("embed_p99_ms")}


def pipeline_markdown(phase: dict[str, Any]) -> str:
    """The phase as a RESULTS.md table: each arrangement's figures, and one process / two processes."""
    s = phase["summary"]
    lines = [f"Pipeline: embeddings ({phase['embed_concurrency']} users x {phase['embed_texts']} text) and reranks "
             f"({phase['rerank_concurrency']} users x 1 query + {phase['documents_per_request']} documents) at once; "
             f"one process with {phase['threads']} threads vs two with {phase['threads_each_of_two']}; "
             f"{len(phase['rounds'])} round(s), median (min-max)", "",
             "| arrangement | embed texts/s | embed P99 ms | rerank pairs/s | rerank P99 ms |", "|---|---|---|---|---|"]

    def cell(d: dict[str, Any]) -> str:
        return "-" if d["median"] is None else f"{d['median']:g} ({d['min']:g}-{d['max']:g})"

    for name in (*ARRANGEMENTS, "one / two"):
        row = s[name]
        lines.append(f"| {name} | " + " | ".join(cell(row[f]) for f in FIGURES) + " |")
    return "\n".join(lines) + "\n"
