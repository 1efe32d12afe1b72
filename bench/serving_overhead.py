"""The serving overhead in CPU: a server's CPU time per text against the same model's in-process CPU time per text.

    python bench/serving_overhead.py [--runtime torch,openvino:bfloat16] [--duration 20] [--rounds 2]

Both are read from the kernel's count of the process's CPU time (user + system, every thread: /proc/<pid>/stat for
the server, getrusage for this process), so the load client's own CPU on a small machine counts for neither:

- in process: this process loads the model on the runtime (the server's own loading code and settings), then
  tokenises, runs and pools the corpus in sorted batches of ``--batch`` texts, as the ceiling of ``inferd bench``
  does (around a compiled graph on one torch thread, as the server's workers: core/instances.py); CPU seconds over
  texts;
- server: ``inferd serve`` (prod overlay) on the same runtime under a closed loop of ``--concurrency`` users, one
  corpus text per request; the server process's CPU seconds over the texts it answered, and the same split by OS
  thread name (``main`` is the event loop; ``inferd-<n>`` the instances' workers; the rest the runtime's pools);
- engine: the server's own engine (the app of the same settings, its lifespan run, no port) in a process of its own,
  under the same traffic: ``--concurrency`` callers on its event loop, one corpus text per call, in the same order.
  Server / engine is what serving adds (HTTP, parsing, validation, the routes, the answer's JSON) for the same
  batches; in process / engine is what the traffic's batches cost against the sorted ones of a corpus run.

Issue 43's target: server / in process <= 1.15. Rounds alternate the order of the sides. The second half of the
issue's item 5, a pipeline of an embedder and a reranker in one process against two on the same cores, is
``inferd bench --phases pipeline --rerank-model <a cross-encoder folder>`` (inferd.bench.pipeline).
``--duration 1 --rounds 1 --texts 64`` checks the script in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from inferd import corpus as bench_corpus
from inferd.bench.ceiling import load_handler as ceiling_handler
from inferd.bench.ceiling import token_counts
from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.procs import inferd_env, start_inferd, thread_cpu
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.settings import ModelSettings, resolve_model_path


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, every thread (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def runtime_env(runtime: str) -> dict[str, str]:
    backend, _, dtype = runtime.partition(":")
    return {"INFERD__MODEL__BACKEND": backend, "INFERD__MODEL__DTYPE": dtype or "float32"}


def in_process(model: Path, runtime: str, texts: list[str], batch: int, cache: Path) -> dict[str, Any]:
    backend, _, dtype = runtime.partition(":")
    handler = load_handler(ModelSpec(model, "bench", backend=backend, dtype=dtype or "float32", device="cpu",
                                     cache_dir=str(cache)))
    threads = torch.get_num_threads()
    if not handler.runner.capabilities.torch_threads:
        torch.set_num_threads(1)  # as the server's workers do around a compiled graph (core/instances.py)
    try:
        encoded = handler.preprocess(texts[:batch])
        handler.postprocess(handler.infer(encoded))  # warm: allocators, the runtime's first shapes
        cpu0, t0 = own_cpu(), time.perf_counter()
        encoded = handler.preprocess(texts)
        order = sorted(range(len(encoded)), key=lambda i: encoded[i].tokens)
        for start in range(0, len(order), batch):
            handler.postprocess(handler.infer([encoded[i] for i in order[start:start + batch]]))
        cpu, wall = own_cpu() - cpu0, time.perf_counter() - t0
    finally:
        handler.close()
        torch.set_num_threads(threads)
    return {"texts": len(texts), "cpu_s": round(cpu, 3), "cpu_ms_per_text": round(1e3 * cpu / len(texts), 4),
            "texts_per_s": round(len(texts) / wall, 1)}


def served(model: Path, runtime: str, source: TextSource, args: argparse.Namespace, logs: Path,
           cache: Path) -> dict[str, Any]:
    env = {**runtime_env(runtime), "INFERD__MODEL__CACHE_DIR": str(cache),
           **dict(item.split("=", 1) for item in args.server_env)}
    server = start_inferd(logs, model, None, env, timeout=900)
    try:
        # A warm-up of its own first (connections, caches, the runtime's first shapes), so the CPU read around the
        # counted loop is the counted texts' only.
        run_closed(Target(server.url), source, args.concurrency, 1, min(3.0, args.duration), 0)
        cpu0, threads0 = process_cpu(server.proc.pid), thread_cpu(server.proc.pid)
        result = run_closed(Target(server.url), source, args.concurrency, 1, args.duration, 0)
        cpu, threads = process_cpu(server.proc.pid) - cpu0, thread_cpu(server.proc.pid)
        rss = int(next(line.split()[1] for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:")))
    finally:
        server.stop()
    return {**cpu_figures(int(result["texts"]), cpu, threads0, threads, result["texts_per_s"]),
            "errors": result["errors"], "rss_mb_after": round(rss / 1024)}


def cpu_figures(texts: int, cpu: float, threads0: dict[str, float], threads: dict[str, float],
                texts_per_s: float) -> dict[str, Any]:
    """A side's CPU per text, whole and by OS thread name (``thread_cpu`` readings before and after)."""
    texts = max(1, texts)
    by_thread = {name: round(1e3 * (threads[name] - threads0.get(name, 0.0)) / texts, 3) for name in threads}
    return {"texts": texts, "cpu_s": round(cpu, 3), "cpu_ms_per_text": round(1e3 * cpu / texts, 4),
            "texts_per_s": texts_per_s,
            "ms_per_text_by_thread": {k: v for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v >= 0.005}}


def engine(model: Path, runtime: str, args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    """The engine side, in a child process of the server's environment (``--engine-child``)."""
    env = inferd_env(model, None, {**runtime_env(runtime), "INFERD__MODEL__CACHE_DIR": str(cache),
                                   **dict(item.split("=", 1) for item in args.server_env)})
    out = subprocess.run([sys.executable, __file__, "--engine-child", "--duration", str(args.duration),
                          "--concurrency", str(args.concurrency)], env=env, capture_output=True, text=True,
                         timeout=900 + 2 * args.duration)
    if out.returncode != 0:
        raise RuntimeError(f"the engine side failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_child(args: argparse.Namespace) -> int:
    """Load the app of the prod settings (the environment's overrides) in this process, then drive its engine with
    ``--concurrency`` closed-loop callers, one corpus text each, as the server's clients do; print the figures."""
    from inferd.api.app import create_app
    from inferd.api.services import services_of
    from inferd.config import load_settings
    from inferd.core.memory import configure_process
    from inferd.utils.logger import configure_logging

    settings = load_settings(os.environ["INFERD_ENV"])
    configure_logging(settings.server.log_level, settings.server.log_format)
    texts = bench_corpus.texts()
    source = TextSource(texts, [1] * len(texts))
    pid = os.getpid()

    async def run() -> dict[str, Any]:
        app = create_app(settings, memory_guard=configure_process(settings))
        async with app.router.lifespan_context(app):
            eng = services_of(app).engine
            while not all(m.manager.state == "ready" for m in eng.registry):
                if any(m.manager.state == "failed" for m in eng.registry):
                    raise RuntimeError("the model failed to load")
                await asyncio.sleep(0.1)
            done = [0]

            async def caller(until: float) -> None:
                while time.perf_counter() < until:
                    result = await eng.process(eng.request([texts[source.take(1)[0]]], task="embedding"))
                    done[0] += len(result.outputs)

            async def phase(seconds: float) -> None:
                until = time.perf_counter() + seconds
                await asyncio.gather(*(caller(until) for _ in range(args.concurrency)))

            await phase(min(3.0, args.duration))  # the server's warm-up, the same length
            done[0] = 0
            cpu0, threads0, t0 = process_cpu(pid), thread_cpu(pid), time.perf_counter()
            await phase(args.duration)
            cpu, threads, wall = process_cpu(pid) - cpu0, thread_cpu(pid), time.perf_counter() - t0
        return cpu_figures(done[0], cpu, threads0, threads, round(done[0] / wall, 2))

    print(json.dumps(asyncio.run(run())), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: the packaged MiniLM)")
    p.add_argument("--runtime", default="torch,openvino:bfloat16", help="backend[:dtype], comma list")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of the server's counted load")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="in process: texts per batch (the server's max batch)")
    p.add_argument("--texts", type=int, default=2048, help="in process: corpus texts run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for the server's environment (repeatable), e.g. INFERD__MODEL__INSTANCES=1")
    p.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine_child:
        return engine_child(args)
    model = args.model or Path(resolve_model_path(ModelSettings()))
    logs = Path(tempfile.mkdtemp(prefix="inferd-overhead-"))
    cache = logs / "cache"  # one export per runtime, shared by both sides
    texts = bench_corpus.texts()
    handler_texts = texts[: args.texts]
    source = TextSource(texts, token_counts(ceiling_handler(model), texts))
    for runtime in args.runtime.split(","):
        for r in range(args.rounds):
            row: dict[str, Any] = {"runtime": runtime, "round": r + 1}
            sides = ["in process", "engine", "server"]
            for name in sides[r % 3:] + sides[: r % 3]:  # rotated
                row[name] = (in_process(model, runtime, handler_texts, args.batch, cache) if name == "in process"
                             else engine(model, runtime, args, cache) if name == "engine"
                             else served(model, runtime, source, args, logs, cache))
            cost = {name: row[name]["cpu_ms_per_text"] for name in sides}
            row["server / in process"] = round(cost["server"] / cost["in process"], 3)
            row["server / engine"] = round(cost["server"] / cost["engine"], 3)
            row["engine / in process"] = round(cost["engine"] / cost["in process"], 3)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
