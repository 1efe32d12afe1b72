"""Where a request's CPU time goes in ``inferd serve``: py-spy samples the server under closed-loop load.

    python bench/profile_server.py [--concurrency 1,32] [--backend torch,openvino:bfloat16] [--duration 20]

For each backend and concurrency: a real ``inferd serve`` (prod overlay, quiet logs) on the packaged MiniLM, a
closed loop of one text per request from the benchmark's load generator (this process), and ``py-spy record``
attached to the server for the measured window (``--nonblocking``: the server is never paused; ``--threads``).
Idle samples (a thread waiting in select, on a lock or a queue) are dropped by py-spy, so each sample is CPU
time of a Python thread; torch's and OpenVINO's own compute threads are not Python threads and are not sampled
(the worker thread's time in the forward pass stands for them). Every stack is put in one stage by its innermost
recognised frame (the rules below, most specific first), split by thread: the event loop (HTTP parsing,
middleware, routing, body decode and validation, tokenisation, queueing and wake-ups, response encoding,
logging, metrics) and the worker (collate, forward pass, pooling, postprocess). The table gives each stage's
share of the server's CPU samples and its CPU milliseconds per request (samples / rate / requests answered in
the window).

py-spy comes from PyPI (the dev lock has it); it needs ptrace permission on the server (root, or
kernel.yama.ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from inferd import corpus as bench_corpus
from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.procs import start_inferd

# (stage, pattern on "function (file)" frames): the innermost frame matching decides the stage.
RULES: list[tuple[str, str]] = [
    ("forward pass", r"\(torch/nn/|\(transformers/|backends/varlen\.py|openvino/|onnxruntime/|_C\._nn|"
                     r"backends/(torch|openvino|onnx)\.py"),
    ("pooling + postprocess", r"tasks/embedding\.py|tasks/base\.py.*pool|postprocess"),
    ("collate", r"collate|backends/base\.py"),
    ("tokenisation", r"tokenizers/|preprocess\.py|encode_batch|\bencode\b"),
    ("metrics", r"prometheus_client/"),
    ("logging", r"\(logging/|utils/logger\.py"),
    ("response encoding", r"orjson|json_response|responses\.py|render"),
    ("body decode + validation", r"_decode|read_body|pydantic|model_validate|check_texts|precheck"),
    ("scheduling + queue", r"core/batcher\.py|core/admission\.py|core/work\.py|core/engine\.py|core/cache\.py"),
    ("routing + middleware", r"starlette/|fastapi/|api/middleware\.py|api/routes\.py|api/inference\.py|"
                             r"api/services\.py"),
    ("HTTP parsing + transport", r"uvicorn/|httptools|inferd/server/http\.py|selector_events\.py|streams\.py"),
    ("event loop + wake-ups", r"asyncio/|threading\.py|concurrent/futures"),
]
_COMPILED = [(stage, re.compile(p)) for stage, p in RULES]


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for stage, pattern in _COMPILED:
            if pattern.search(frame):
                return stage
    return "other"


def thread_of(frames: list[str]) -> str:
    text = ";".join(frames)
    if "core/worker.py" in text:
        return "worker"
    if "concurrent/futures/thread.py" in text or "WorkerThread.run (anyio/" in text:
        return "thread pool"  # asyncio.to_thread's, and anyio's (FastAPI runs plain-def dependencies there)
    if "asyncio" in text or "uvicorn" in text or "inferd/server/" in text:
        return "event loop"
    return "other threads"


def parse_collapsed(text: str) -> Counter[tuple[str, str]]:
    """py-spy's --format raw (collapsed stacks): 'frame;frame;... count' per line, outermost first."""
    out: Counter[tuple[str, str]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        out[(thread_of(frames), stage_of(frames))] += int(count)
    return out


def profile_one(backend: str, concurrency: int, duration: float, rate: int, logs: Path,
                texts: list[str], tokens: list[int]) -> dict:
    name, _, dtype = backend.partition(":")
    env = {"INFERD__MODEL__BACKEND": name}
    if dtype:
        env["INFERD__MODEL__DTYPE"] = dtype
    server = start_inferd(logs, None, None, env, timeout=600)
    try:
        target = Target(server.url)
        run_closed(target, TextSource(texts, tokens, seed=1), concurrency, 1, 3.0, 0.0)  # warm caches, pools
        out = logs / f"pyspy-{name}-{dtype or 'default'}-c{concurrency}.txt"
        spy = subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
                                "--pid", str(server.proc.pid), "--rate", str(rate), "--duration",
                                str(int(duration) + 2), "--format", "raw", "--threads", "--nonblocking",
                                "--output", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # py-spy attached before the measured window opens
        result = run_closed(target, TextSource(texts, tokens, seed=2), concurrency, 1, duration, 0.0)
        spy.wait(60)
    finally:
        server.stop()
    samples = parse_collapsed(out.read_text()) if out.exists() else Counter()
    return {"backend": backend, "concurrency": concurrency, "requests": result["ok_requests"],
            "texts_per_s": result["texts_per_s"], "p50_ms": result["p50_ms"], "samples": samples,
            "rate": rate, "server_stages_ms": {k: result.get(k) for k in result if k.endswith("_ms_mean")},
            "window_s": duration + 2, "result": result}


def table(run: dict) -> str:
    samples: Counter[tuple[str, str]] = run["samples"]
    total = sum(samples.values()) or 1
    # py-spy's window is the load's plus 2 s margins: scale requests to the window it sampled.
    per_req = 1e3 / run["rate"] / max(run["requests"] * run["window_s"] / (run["window_s"] - 2), 1)
    by_thread: dict[str, Counter[str]] = defaultdict(Counter)
    for (thread, stage), n in samples.items():
        by_thread[thread][stage] += n
    lines = [f"**{run['backend']} @ c={run['concurrency']}**: {run['texts_per_s']:.1f} texts/s, P50 "
             f"{run['p50_ms']:.1f} ms, {total} CPU samples at {run['rate']} Hz", "",
             "| thread | stage | share of server CPU | CPU ms / request |", "|---|---|---|---|"]
    for thread, stages in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
        for stage, n in stages.most_common():
            lines.append(f"| {thread} | {stage} | {n / total:.1%} | {n * per_req:.2f} |")
        n = sum(stages.values())
        lines.append(f"| {thread} | **all** | **{n / total:.1%}** | **{n * per_req:.2f}** |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch,openvino:bfloat16")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second (250)")
    p.add_argument("--out", type=Path, default=Path("bench/out/profile.md"))
    p.add_argument("--logs", type=Path)
    args = p.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="inferd-profile-"))
    texts = bench_corpus.texts()
    tokens = [bench_corpus.estimate_tokens(t) for t in texts]
    parts, raw = [], []
    for backend in args.backend.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            print(f"profiling {backend} at c={c} for {args.duration:g} s", flush=True)
            run = profile_one(backend, c, args.duration, args.rate, logs, texts, tokens)
            parts.append(table(run))
            print(parts[-1], flush=True)
            raw.append({**run, "samples": {f"{t}|{s}": n for (t, s), n in run["samples"].items()}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"`{' '.join(['python', *sys.argv])}`\n\n" + "\n".join(parts))
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    print(f"wrote {args.out}; py-spy's stacks in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
