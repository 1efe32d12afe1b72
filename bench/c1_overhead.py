"""What the serving path adds to one request at concurrency 1: client latency minus the model's own time.

    python bench/c1_overhead.py [--backend torch] [--requests 400]

A real ``inferd serve`` (prod overlay, quiet logs) on the packaged MiniLM; one client on one keep-alive
connection (http.client, the cheapest there is) sends one corpus text per request, one after the other. Each
answer carries the server's own timings: X-Inference-Time (the batch's forward pass and pooling, this request
alone in it) and X-Queue-Time. The overhead of a request is its latency at the client minus X-Inference-Time:
HTTP in and out on loopback, routing, validation, tokenising, queueing and the wake-ups between the event loop
and the worker. Reported as the median over requests, with P90, beside the median forward pass.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from inferd import corpus as bench_corpus
from inferd.bench.procs import start_inferd


def measure(url: str, texts: list[str], n: int) -> dict[str, float]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    latency, forward, queue = [], [], []
    try:
        for i in range(n + 20):
            body = json.dumps({"texts": [texts[i % len(texts)]]})
            t0 = time.perf_counter()
            conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            elapsed = (time.perf_counter() - t0) * 1e3
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
            if i >= 20:  # the first requests warm caches and allocators
                latency.append(elapsed)
                forward.append(float(r.getheader("X-Inference-Time")))
                queue.append(float(r.getheader("X-Queue-Time")))
    finally:
        conn.close()
    overhead = sorted(a - b for a, b in zip(latency, forward, strict=True))
    return {"requests": n, "latency_p50_ms": round(statistics.median(latency), 3),
            "forward_p50_ms": round(statistics.median(forward), 3),
            "queue_p50_ms": round(statistics.median(queue), 3),
            "overhead_p50_ms": round(statistics.median(overhead), 3),
            "overhead_p90_ms": round(overhead[int(0.9 * (len(overhead) - 1))], 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch", help="torch, or e.g. openvino:bfloat16 (comma list)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="inferd-c1-"))
    texts = bench_corpus.texts()
    for backend in args.backend.split(","):
        name, _, dtype = backend.partition(":")
        env = {"INFERD__MODEL__BACKEND": name, **({"INFERD__MODEL__DTYPE": dtype} if dtype else {})}
        server = start_inferd(logs, None, None, env, timeout=600)
        try:
            for r in range(args.rounds):
                print(json.dumps({"backend": backend, "round": r + 1, **measure(server.url, texts, args.requests)}),
                      flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
