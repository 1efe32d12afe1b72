"""backend auto from outside: time from start to serving (torch) and to serving on the fast runtime, from an empty
cache and from a warm one, then texts/s of torch against auto after its switch, the same model, same machine.

    python bench/auto_start.py [--model minilm,mpnet] [--duration 20] [--concurrency 32]

Per model: (1) a server with ``backend: auto`` on an empty cache folder: seconds to /health/ready (torch serves) and
to /info's ``auto.state`` done (the switch; its runtime and every candidate's verdict are printed); (2) the same on
the now warm cache; (3) closed-loop texts/s (one corpus text per request) of that warm auto server, after its
switch, and of a ``backend: torch`` server, alternated ``--rounds`` times. Issue 43's targets on 2 cores for
all-mpnet-base-v2: the fast runtime serving <= 120 s from an empty cache (torch from ~5 s), <= 10 s warm.

Each line printed is one JSON record; a run of both models at the defaults takes about 6 minutes on 2 cores (the
cold mpnet start dominates). ``--duration 1 --model minilm`` checks the script in under two minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from inferd import corpus as bench_corpus
from inferd.bench.ceiling import load_handler, token_counts
from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.mpnet import mpnet_folder
from inferd.bench.procs import ServerProc, start_inferd
from inferd.settings import ModelSettings, resolve_model_path


def model_path(name: str) -> Path:
    return Path(resolve_model_path(ModelSettings())) if name == "minilm" else mpnet_folder()


def auto_state(url: str) -> dict[str, Any]:
    try:
        return httpx.get(url + "/info", timeout=5).json().get("auto") or {}
    except (httpx.HTTPError, ValueError):
        return {}


def timed_start(logs: Path, model: Path, cache: Path, timeout: float) -> tuple[ServerProc, dict[str, Any]]:
    """A backend auto server: seconds to ready (torch) and to the end of judging (the switch, or none)."""
    t0 = time.monotonic()
    server = start_inferd(logs, model, None, {"INFERD__MODEL__BACKEND": "auto",
                                              "INFERD__MODEL__CACHE_DIR": str(cache)}, timeout=timeout)
    ready = time.monotonic() - t0
    state: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout:
        state = auto_state(server.url)
        if state.get("state") == "done":
            break
        time.sleep(0.2)
    fast = time.monotonic() - t0 if state.get("state") == "done" else None
    verdicts = {c["candidate"]: {"state": c["state"], "seconds": c["seconds"],
                                 "reason": (c["reason"] or "")[:160] or None} for c in state.get("candidates", [])}
    return server, {"ready_on_torch_s": round(ready, 1), "fast_runtime_s": None if fast is None else round(fast, 1),
                    "serving": state.get("serving"), "candidates": verdicts}


def throughput(url: str, source: TextSource, args: argparse.Namespace) -> float:
    result = run_closed(Target(url), source, args.concurrency, 1, args.duration, min(5.0, args.duration))
    return float(result["texts_per_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm,mpnet", help="minilm and/or mpnet (comma list)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each throughput phase")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="torch / auto alternations per model")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take to switch")
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="inferd-auto-start-"))
    texts = bench_corpus.texts()
    for name in args.model.split(","):
        model = model_path(name)
        cache = Path(tempfile.mkdtemp(prefix=f"inferd-auto-cache-{name}-"))
        try:
            for start in ("cold", "warm"):
                server, figures = timed_start(logs, model, cache, args.timeout)
                print(json.dumps({"model": name, "start": start, **figures}), flush=True)
                if start == "cold":
                    server.stop()
            tokens = token_counts(load_handler(model), texts)
            source = TextSource(texts, tokens)
            torch_server = start_inferd(logs, model, None, {"INFERD__MODEL__BACKEND": "torch"}, timeout=args.timeout)
            try:
                for r in range(args.rounds):
                    order = [("torch", torch_server), ("auto", server)]
                    for label, srv in order if r % 2 == 0 else order[::-1]:
                        print(json.dumps({"model": name, "round": r + 1, "server": label,
                                          "runtime": auto_state(srv.url).get("serving", "torch-float32"),
                                          "texts_per_s": throughput(srv.url, source, args)}), flush=True)
            finally:
                torch_server.stop()
                server.stop()
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
