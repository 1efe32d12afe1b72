"""What shadow traffic costs live traffic: throughput and P99 with a shadow candidate sampling 0 %, 10 % and 50 %
of the requests, with the shadow lane's batch caps and without them, in one run (issue 22).

    .venv/bin/python bench/shadow.py                                  # MiniLM, 3 rounds of 20 s per setting
    .venv/bin/python bench/shadow.py --rounds 1 --duration 3 --model-path /path/to/tiny   # a quick check

Two ``inferd serve`` (the prod overlay, an admin key) serve the model, both up for the whole run and loaded one
at a time: ``capped`` with the shadow.* defaults (shadow batches of at most 8 texts / 1024 tokens), ``uncapped``
with shadow batches as large as live ones (``--variants`` picks). The candidate is the same folder
(``--shadow-backend``: the same runtime by default, so a sampled request costs the device twice its live
compute; ``openvino`` for a candidate on another backend). Each round runs every server and setting, in a rotated
order, each as a closed loop (``--concurrency`` users) and an open loop at ``--rate`` requests/s (default: 60 %
of the first 0 % throughput); 0 % is no shadow at all. Ratios are taken within each round against the same
server's 0 %. Writes ``--out`` (JSON) and prints a table of the ranges over rounds; the shadow counts (computed,
shed) say how much was mirrored.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from inferd.bench.load import Target, TextSource, run_closed, run_open
from inferd.bench.procs import start_inferd
from inferd.corpus import texts as corpus_texts
from inferd.settings import ModelSettings, resolve_model_path

KEY = "bench-shadow"
ADMIN = {"Authorization": f"Bearer {KEY}"}
WEIGHTS = (0.0, 0.1, 0.5)


def set_shadow(url: str, path: Path, weight: float, backend: str | None, n: int) -> None:
    with httpx.Client(base_url=url, timeout=600) as c:
        c.delete("/admin/models/shadow", headers=ADMIN)
        if weight > 0:
            body: dict[str, Any] = {"path": str(path), "version": f"shadow-{n}", "weight": weight}
            if backend:
                body["backend"] = backend
            r = c.post("/admin/models/shadow", json=body, headers=ADMIN)
            r.raise_for_status()


def shadow_counts(url: str) -> dict[str, int] | None:
    r = httpx.get(url + "/admin/models/shadow", headers=ADMIN, timeout=30)
    return r.json()["report"]["requests"] if r.status_code == 200 else None


# The shadow lane's batch caps compared in one run: the defaults (shadow.max_batch_size 8, max_batch_tokens
# 1024) and the live batching's own limits (what shadow batches took before the caps existed).
VARIANTS = {"capped": {}, "uncapped": {"INFERD__SHADOW__MAX_BATCH_SIZE": "32",
                                       "INFERD__SHADOW__MAX_BATCH_TOKENS": "8192"}}


def span(values: list[float]) -> str:
    return f"{min(values)}–{max(values)}" if values else "–"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, help="default: the packaged all-MiniLM-L6-v2")
    p.add_argument("--shadow-backend", choices=("torch", "onnx", "openvino"), help="default: the model's own")
    p.add_argument("--variants", default="capped,uncapped",
                   help="servers compared, comma-separated: capped (the shadow.* defaults), uncapped (shadow "
                        "batches as large as live ones)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per closed and per open loop")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, help="open loop requests/s (default: 60 %% of round 1's 0 %% throughput)")
    p.add_argument("--texts", type=int, default=512, help="corpus texts sent (one per request)")
    p.add_argument("--torch-threads", type=int)
    p.add_argument("--out", type=Path, default=Path("bench/out/shadow.json"))
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: a comma-separated list of {', '.join(VARIANTS)}")

    model = args.model_path or resolve_model_path(ModelSettings())
    texts = corpus_texts(args.texts, seed=5)
    source = TextSource(texts, [max(1, len(t.split())) for t in texts], seed=1)
    logs = Path(tempfile.mkdtemp(prefix="inferd-bench-shadow-"))
    servers = {}
    rounds: list[dict[str, Any]] = []
    rate = args.rate
    try:
        # Both servers are up for the whole run; only one is loaded at a time.
        for v in variants:
            servers[v] = start_inferd(logs, model, args.torch_threads, {
                "INFERD__SERVER__ADMIN_KEY": KEY, "INFERD__MODEL__ROOT": str(model.parent),
                "INFERD__MODEL__CACHE_DIR": str(logs / "cache"), **VARIANTS[v]}, name=f"inferd-{v}")
        for r in range(args.rounds):
            results: dict[str, Any] = {}
            order = [(v, w) for v in variants for w in WEIGHTS]
            order = order[r % len(order):] + order[:r % len(order)]  # rotated: no setting always goes first
            for v, weight in order:
                url = servers[v].url
                set_shadow(url, model, weight, args.shadow_backend, r * 10 + int(weight * 100))
                closed = run_closed(Target(url), source, args.concurrency, 1, args.duration, args.warmup)
                if rate is None and weight == 0.0:
                    rate = round(0.6 * closed["requests_per_s"], 1)
                opened = run_open(Target(url), source, rate, args.duration, args.warmup) if rate else None
                counts = shadow_counts(url)
                results[f"{v} {int(weight * 100)}%"] = {"closed": closed, "open": opened, "shadow": counts}
                open_part = f"; open at {rate}/s P99 {opened['p99_ms']} ms" if opened else ""
                print(f"round {r + 1} {v} shadow {int(weight * 100):>2}%: closed {closed['texts_per_s']} texts/s "
                      f"P99 {closed['p99_ms']} ms{open_part}; shadow {counts}", flush=True)
            for v in variants:
                base = results[f"{v} 0%"]
                for w in WEIGHTS:
                    res = results[f"{v} {int(w * 100)}%"]
                    res["ratio"] = {
                        "throughput": round(res["closed"]["texts_per_s"] / base["closed"]["texts_per_s"], 3),
                        "p99_closed": round(res["closed"]["p99_ms"] / base["closed"]["p99_ms"], 3)}
                    if res["open"] and base["open"]:
                        res["ratio"]["p99_open"] = round(res["open"]["p99_ms"] / base["open"]["p99_ms"], 3)
            rounds.append(results)
    finally:
        for server in servers.values():
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(model), "shadow_backend": args.shadow_backend,
                                    "concurrency": args.concurrency, "open_rate": rate, "rounds": rounds,
                                    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    print(f"\n{len(rounds)} rounds; each cell is the range over rounds (ratios against the same server's 0 %)")
    print("| server | shadow | texts/s (closed) | P99 ms (closed) | P99 ms (open) | throughput ratio "
          "| P99 ratio (open) | mirrors computed / shed |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        for w in WEIGHTS:
            rows = [rd[f"{v} {int(w * 100)}%"] for rd in rounds]
            counts = [x["shadow"] for x in rows if x["shadow"]]
            mirrored = " / ".join(span([c[k] for c in counts]) for k in ("computed", "shed")) if counts else "–"
            print(f"| {v} | {int(w * 100)} % | {span([x['closed']['texts_per_s'] for x in rows])} "
                  f"| {span([x['closed']['p99_ms'] for x in rows])} "
                  f"| {span([x['open']['p99_ms'] for x in rows if x['open']])} "
                  f"| {span([x['ratio']['throughput'] for x in rows])} "
                  f"| {span([x['ratio']['p99_open'] for x in rows if 'p99_open' in x['ratio']])} | {mirrored} |")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
