"""What shadow traffic costs live traffic: throughput and P99 with a shadow candidate sampling 0 %, 10 % and 50 %
of the requests, in one run on one server (issue 22).

    .venv/bin/python bench/shadow.py                                  # MiniLM, 3 rounds of 20 s per setting
    .venv/bin/python bench/shadow.py --rounds 1 --duration 3 --model-path /path/to/tiny   # a quick check

One ``inferd serve`` (the prod overlay, an admin key) serves the model; the candidate is the same folder
(``--shadow-backend``: the same runtime by default, so a sampled request costs the device twice its live
compute; ``openvino`` for a candidate on another backend). Each round runs every setting, in a rotated order,
each as a closed loop (``--concurrency`` users) and an open loop at ``--rate`` requests/s (default: 60 % of the
first round's 0 % throughput); 0 % is no shadow at all. Ratios are taken within each round against its 0 %.
Writes ``--out`` (JSON) and prints a table; the shadow counts (computed, shed) say how much was mirrored.
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
from inferd.config import ModelSettings, resolve_model_path
from inferd.corpus import texts as corpus_texts

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, help="default: the packaged all-MiniLM-L6-v2")
    p.add_argument("--shadow-backend", choices=("torch", "onnx", "openvino"), help="default: the model's own")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per closed and per open loop")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, help="open loop requests/s (default: 60 %% of round 1's 0 %% throughput)")
    p.add_argument("--texts", type=int, default=512, help="corpus texts sent (one per request)")
    p.add_argument("--torch-threads", type=int)
    p.add_argument("--out", type=Path, default=Path("bench/out/shadow.json"))
    args = p.parse_args(argv)

    model = args.model_path or resolve_model_path(ModelSettings())
    texts = corpus_texts(args.texts, seed=5)
    source = TextSource(texts, [max(1, len(t.split())) for t in texts], seed=1)
    logs = Path(tempfile.mkdtemp(prefix="inferd-bench-shadow-"))
    server = start_inferd(logs, model, args.torch_threads, {
        "INFERD__SERVER__ADMIN_KEY": KEY, "INFERD__MODEL__ROOT": str(model.parent),
        "INFERD__MODEL__CACHE_DIR": str(logs / "cache")})
    target = Target(server.url)
    rounds: list[dict[str, Any]] = []
    rate = args.rate
    try:
        for r in range(args.rounds):
            order = WEIGHTS[r % len(WEIGHTS):] + WEIGHTS[:r % len(WEIGHTS)]
            results: dict[str, Any] = {}
            for weight in order:
                set_shadow(server.url, model, weight, args.shadow_backend, r * 10 + int(weight * 100))
                closed = run_closed(target, source, args.concurrency, 1, args.duration, args.warmup)
                if rate is None:
                    rate = round(0.6 * closed["requests_per_s"], 1) if weight == 0.0 else None
                opened = run_open(target, source, rate, args.duration, args.warmup) if rate else None
                counts = shadow_counts(server.url)
                results[f"{int(weight * 100)}%"] = {"closed": closed, "open": opened, "shadow": counts}
                open_part = f"; open at {rate}/s P99 {opened['p99_ms']} ms" if opened else ""
                print(f"round {r + 1} shadow {int(weight * 100):>2}%: closed {closed['texts_per_s']} texts/s "
                      f"P99 {closed['p99_ms']} ms{open_part}; shadow {counts}", flush=True)
            if rate is None:  # the 0 % setting came after others in this round's order: open loops next round
                rate = round(0.6 * results["0%"]["closed"]["requests_per_s"], 1)
            base = results["0%"]["closed"]
            for res in results.values():
                res["ratio"] = {"throughput": round(res["closed"]["texts_per_s"] / base["texts_per_s"], 3),
                                "p99_closed": round(res["closed"]["p99_ms"] / base["p99_ms"], 3)}
                if res["open"] and results["0%"]["open"]:
                    res["ratio"]["p99_open"] = round(res["open"]["p99_ms"] / results["0%"]["open"]["p99_ms"], 3)
            rounds.append(results)
    finally:
        server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(model), "shadow_backend": args.shadow_backend,
                                    "concurrency": args.concurrency, "open_rate": rate, "rounds": rounds,
                                    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    print("\n| shadow | texts/s (closed) | P99 ms (closed) | P99 ms (open) | throughput ratio | P99 ratio (closed) |")
    print("|---|---|---|---|---|---|")
    for key in ("0%", "10%", "50%"):
        rows = [rd[key] for rd in rounds]
        tput = [x["closed"]["texts_per_s"] for x in rows]
        p99 = [x["closed"]["p99_ms"] for x in rows]
        p99o = [x["open"]["p99_ms"] for x in rows if x["open"]]
        ratio = [x["ratio"]["throughput"] for x in rows]
        rp99 = [x["ratio"]["p99_closed"] for x in rows]
        print(f"| {key} | {min(tput)}–{max(tput)} | {min(p99)}–{max(p99)} | "
              f"{(str(min(p99o)) + '–' + str(max(p99o))) if p99o else '–'} | {min(ratio)}–{max(ratio)} | "
              f"{min(rp99)}–{max(rp99)} |")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
