"""The rerank phase of ``inferd bench``: a cross-encoder served by ``inferd serve``, one query and 32 documents
per request on /v1/rerank, closed loop. It reports pairs/s (each document is one pair, one batch item) beside
the embedding phases' texts/s: a pair costs a query's tokens more than a text, so the two are not one figure.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.procs import start_inferd

DOCUMENTS_PER_REQUEST = 32
QUERY = "which of these passages answers the question about the river and the city"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rerank-model", type=Path,
                   help="rerank phase: a cross-encoder folder (BertForSequenceClassification, one label); "
                        "without it the phase is skipped")
    p.add_argument("--rerank-concurrency", type=int, default=8, help="rerank phase: closed-loop users (8)")


def run_phase(args: argparse.Namespace, source: TextSource, say: Callable[[str], None],
              logs: Path) -> dict[str, Any]:
    """One closed-loop rerank phase; raises when the server cannot start (the caller records the error)."""
    model = args.rerank_model.resolve()
    say(f"starting inferd serve on the cross-encoder {model}")
    server = start_inferd(logs, model, args.torch_threads,
                          {"INFERD__MODEL__DEVICE": args.device, "INFERD__MODEL__TASK": "rerank",
                           **dict(args.server_env)})
    try:
        c = args.rerank_concurrency
        say(f"rerank@{c}x{DOCUMENTS_PER_REQUEST}: closed loop, 1 query + {DOCUMENTS_PER_REQUEST} documents "
            f"per request, {args.duration:g} s")
        target = Target(server.url, path="/v1/rerank", field_name="documents", client=args.client, query=QUERY)
        result = run_closed(target, source, c, DOCUMENTS_PER_REQUEST, args.duration, args.warmup)
    finally:
        server.stop()
    # Each document sent is one (query, document) pair: the load generator's "texts" are pairs here.
    result["pairs_per_s"] = result["texts_per_s"]
    result["documents_per_request"] = DOCUMENTS_PER_REQUEST
    return result
