"""Long documents (issue 41): what chunking costs beyond its tokens, the server's memory for a 1 MB document, and
what a stream of long documents does to short requests beside it. One ``inferd serve`` (prod overlay, result cache
off so nothing is answered twice) of the packaged all-MiniLM-L6-v2, one run:

    python bench/long_docs.py [--quick] [--sizes 1000,10000,100000] [--rounds 3] [--concurrency 2]

1. **Throughput**, per document size (tokens): the documents sent with ``chunking`` (mode pooled, as many
   documents per request as make about 32 pieces, one at least) against the very same pieces (the spans the
   server chose, asked once untimed in mode pieces) sent as short texts, 32 per request; texts/s and tokens/s (the
   pieces' tokens) each way, and chunked / separate (target >= 0.95: chunking must cost nothing beyond its
   tokens). Each round runs both ways, the order rotated.
2. **Peak RSS** of the server (its VmHWM in /proc, before and after) for one document of ``--doc-mb`` MB (1 MB).
3. **P99 of short requests** (one corpus text each, ``--rate`` per second, open loop) alone, then beside a stream
   of 10,000-token documents sent back to back; P50/P99 ms each, and how many documents the stream got through.

``--quick`` (for a check; <= 3 minutes on 2 cores): sizes 1000 and 10000, one round, 20 s per P99 phase.
The lead's command on a quiet machine: ``python bench/long_docs.py`` (about 12 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from inferd import corpus as bench_corpus
from inferd.bench.procs import start_inferd
from inferd.settings import ModelSettings, resolve_model_path

BATCH = 32  # short texts per request, the separate way
LONG_DOC_TOKENS = 10_000  # the stream beside the short requests


def build_document(texts: list[str], tokenizer: Tokenizer, tokens: int, start: int) -> str:
    """Corpus texts as paragraphs (English, Chinese and mixed), from ``start``, until ``tokens`` tokens."""
    out: list[str] = []
    count, i = 0, start
    while count < tokens:
        text = texts[i % len(texts)]
        out.append(text)
        count += len(tokenizer.encode(text, add_special_tokens=False).ids)
        i += 1
    return "\n\n".join(out)


def post(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/embeddings", json={**body, "timeout_ms": 600_000})
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return r.json()


def chunked(url: str, groups: list[list[str]], concurrency: int) -> float:
    """Seconds to embed the documents with chunking, a group per request."""
    def send(group: list[str]) -> None:
        with httpx.Client(base_url=url, timeout=900) as client:
            post(client, {"input": group, "chunking": {"mode": "pooled"}})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, groups))
    return time.perf_counter() - t0


def grouped(docs: list[str], pieces: list[int]) -> list[list[str]]:
    """Documents in requests of about BATCH pieces each (one document at least), as the separate way sends BATCH
    pieces a request: both ways keep the same work in flight."""
    groups: list[list[str]] = [[]]
    held = 0
    for doc, n in zip(docs, pieces, strict=True):
        if groups[-1] and held + n > BATCH:
            groups.append([])
            held = 0
        groups[-1].append(doc)
        held += n
    return groups


def separate(url: str, pieces: list[str], concurrency: int) -> float:
    """Seconds to embed the same pieces as short texts, BATCH per request."""
    batches = [pieces[i:i + BATCH] for i in range(0, len(pieces), BATCH)]

    def send(batch: list[str]) -> None:
        with httpx.Client(base_url=url, timeout=900) as client:
            post(client, {"input": batch})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, batches))
    return time.perf_counter() - t0


def throughput(url: str, texts: list[str], tokenizer: Tokenizer, size: int, budget: int, rounds: int,
               concurrency: int) -> dict[str, Any]:
    n = max(1, budget // size)
    docs = [build_document(texts, tokenizer, size, 97 * i) for i in range(n)]
    with httpx.Client(base_url=url, timeout=900) as client:
        spans = [post(client, {"input": [d], "chunking": {"mode": "pieces"}})["data"][0]["pieces"] for d in docs]
    pieces = [d[p["start"]:p["end"]] for d, found in zip(docs, spans, strict=True) for p in found]
    tokens = sum(p["tokens"] for found in spans for p in found)
    groups = grouped(docs, [len(found) for found in spans])
    ratios, rows = [], []
    for r in range(rounds):
        ways = [("chunked", lambda: chunked(url, groups, concurrency)),
                ("separate", lambda: separate(url, pieces, concurrency))]
        if r % 2:
            ways.reverse()
        took = {name: run() for name, run in ways}
        ratios.append(took["separate"] / took["chunked"])
        rows.append({way: {"texts_per_s": round(len(docs if way == "chunked" else pieces) / s, 2),
                           "tokens_per_s": round(tokens / s, 1), "seconds": round(s, 2)} for way, s in took.items()})
    return {"size_tokens": size, "documents": n, "pieces": len(pieces), "piece_tokens": tokens, "rounds": rows,
            "chunked_over_separate_median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def peak_rss_mb(pid: int) -> tuple[float, float]:
    """The process's resident memory now and its peak so far (VmRSS, VmHWM), MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def one_megabyte(url: str, pid: int, texts: list[str], tokenizer: Tokenizer, mb: float) -> dict[str, Any]:
    doc, i = [], 0
    size = 0
    while size < mb * 1_000_000:
        doc.append(texts[i % len(texts)])
        size += len(texts[i % len(texts)].encode()) + 2
        i += 1
    text = "\n\n".join(doc)
    rss, hwm = peak_rss_mb(pid)
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=1800) as client:
        answer = post(client, {"input": [text], "chunking": {"mode": "pooled"}})
    took = time.perf_counter() - t0
    after, peak = peak_rss_mb(pid)
    return {"document_bytes": len(text.encode()), "tokens": answer["usage"]["prompt_tokens"], "seconds": round(took, 1),
            "rss_before_mb": round(rss, 1), "peak_before_mb": round(hwm, 1), "rss_after_mb": round(after, 1),
            "peak_after_mb": round(peak, 1), "peak_growth_mb": round(peak - max(rss, hwm), 1)}


def short_latencies(url: str, texts: list[str], rate: float, seconds: float, stream: str | None) -> dict[str, Any]:
    """Open-loop short requests at ``rate``/s for ``seconds``; a stream of ``stream`` documents meanwhile."""
    stop = threading.Event()
    streamed = [0]

    def streaming() -> None:
        with httpx.Client(base_url=url, timeout=900) as client:
            while not stop.is_set():
                post(client, {"input": [stream], "chunking": {"mode": "pooled"}})
                streamed[0] += 1

    def one(text: str) -> float:
        with httpx.Client(base_url=url, timeout=120) as client:
            t0 = time.perf_counter()
            post(client, {"input": [text]})
            return (time.perf_counter() - t0) * 1e3

    streamer = threading.Thread(target=streaming, daemon=True) if stream else None
    if streamer is not None:
        streamer.start()
        time.sleep(1.0)  # the stream's first pieces are queued
    futures = []
    with ThreadPoolExecutor(64) as pool:
        t0 = time.perf_counter()
        k = 0
        while (now := time.perf_counter() - t0) < seconds:
            due = k / rate
            if now < due:
                time.sleep(due - now)
            futures.append(pool.submit(one, texts[k % len(texts)]))
            k += 1
        ms = sorted(f.result() for f in futures)
    stop.set()
    if streamer is not None:
        streamer.join()
    return {"requests": len(ms), "p50_ms": round(ms[len(ms) // 2], 1),
            "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1), "documents_streamed": streamed[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None, help="document sizes in tokens, comma-separated")
    p.add_argument("--budget", type=int, default=None, help="tokens per size and way (documents = budget // size)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--doc-mb", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=5.0, help="short requests per second")
    p.add_argument("--p99-seconds", type=float, default=None)
    args = p.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1000,10000" if args.quick else "1000,10000,100000")).split(",")]
    budget = args.budget or (20_000 if args.quick else 100_000)
    rounds = args.rounds or (1 if args.quick else 3)
    p99_seconds = args.p99_seconds or (20.0 if args.quick else 60.0)
    folder = resolve_model_path(ModelSettings())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()  # the packaged tokenizer.json pads to 128, which would count padding as text
    texts = bench_corpus.texts()
    work = Path(tempfile.mkdtemp(prefix="inferd-long-docs-"))
    env = {"INFERD__CACHE__MAX_ENTRIES": "0", "INFERD__BATCHING__MAX_QUEUE": "1024"}
    server = start_inferd(work / "logs", folder, None, env, timeout=600)
    try:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            # Warm up with full batches, so the peak memory before the 1 MB document is the forward pass's own.
            post(client, {"input": texts[:256]})
        for size in sizes:
            print(json.dumps({"throughput": throughput(server.url, texts, tokenizer, size, budget, rounds,
                                                       args.concurrency)}), flush=True)
        print(json.dumps({"one_document": one_megabyte(server.url, server.proc.pid, texts, tokenizer, args.doc_mb)}),
              flush=True)
        stream = build_document(texts, tokenizer, LONG_DOC_TOKENS, 5)
        for name, beside in (("short alone", None), ("short beside long documents", stream)):
            print(json.dumps({"latency": name, **short_latencies(server.url, texts, args.rate, p99_seconds, beside)}),
                  flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
