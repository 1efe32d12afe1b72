"""A text's dense vector alone, vs its dense, sparse and multi-vector outputs from one forward pass, vs the same three
asked in three requests: same model, same server, same texts, one run.

    python bench/hybrid_outputs.py [--texts 256] [--batch 16] [--concurrency 4] [--rounds 3]

The model is the packaged all-MiniLM-L6-v2 with bge-m3's two heads written beside it (``sparse_linear`` 384->1 and
``colbert_linear`` 384->128, random: the cost does not depend on their values), so inferd serves it as a bge-m3
folder (core/tasks/m3.py) on MiniLM's real encoder and tokenizer. One ``inferd serve`` (prod overlay, result cache
off) answers POST /v1/encode; ``--concurrency`` clients send ``--batch`` corpus texts per request. Each round runs the
three modes one after the other on the same texts (order rotated per round, so none always runs on a warmer or
quieter machine) and reports texts/s, the response bytes per text, and each mode's throughput over dense-only's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from inferd import corpus as bench_corpus
from inferd.bench.procs import start_inferd
from inferd.settings import ModelSettings, resolve_model_path

ALL = ["dense", "sparse", "multivector"]
MODES = {"dense only": [["dense"]], "three outputs, one pass": [ALL], "three requests": [[k] for k in ALL]}


def write_model(folder: Path) -> Path:
    """MiniLM's folder with bge-m3's heads beside it."""
    shutil.copytree(resolve_model_path(ModelSettings()), folder)
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(384, 1).state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(384, 128).state_dict(), folder / "colbert_linear.pt")
    return folder


def run_mode(url: str, batches: list[list[str]], asks: list[list[str]], concurrency: int) -> dict[str, float]:
    def send(batch: list[str]) -> int:
        size = 0
        with httpx.Client(base_url=url, timeout=300) as client:
            for outputs in asks:
                r = client.post("/v1/encode", json={"input": batch, "outputs": outputs, "timeout_ms": 300_000})
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
                size += len(r.content)
        return size

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        sizes = list(pool.map(send, batches))
    elapsed = time.perf_counter() - t0
    texts = sum(map(len, batches))
    return {"texts_per_s": round(texts / elapsed, 2), "bytes_per_text": round(sum(sizes) / texts)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inferd-hybrid-"))
    model = write_model(work / "minilm-m3")
    texts = bench_corpus.texts()[: args.texts]
    batches = [texts[i: i + args.batch] for i in range(0, len(texts), args.batch)]
    env = {"INFERD__CACHE__MAX_ENTRIES": "0", "INFERD__LIMITS__MAX_MULTIVECTOR_TOKENS": "1000000"}
    server = start_inferd(work / "logs", model, None, env, timeout=600)
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        run_mode(server.url, batches[:2], [ALL], args.concurrency)  # warm up
        names = list(MODES)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            got = {m: run_mode(server.url, batches, MODES[m], args.concurrency) for m in order}
            base = got["dense only"]["texts_per_s"]
            for m in names:
                ratios[m].append(got[m]["texts_per_s"] / base)
                print(json.dumps({"round": r + 1, "mode": m, **got[m],
                                  "vs_dense_only": round(got[m]["texts_per_s"] / base, 3)}), flush=True)
    finally:
        server.stop()
    for m in MODES:
        print(json.dumps({"mode": m, "vs_dense_only_median": round(statistics.median(ratios[m]), 3),
                          "min": round(min(ratios[m]), 3), "max": round(max(ratios[m]), 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
