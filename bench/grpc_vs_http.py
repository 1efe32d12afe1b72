"""TEI's gRPC API against its HTTP API on the same server (issue 44): texts/s, P50/P99 latency and server CPU per
text, one text per call or message, as TEI's gRPC clients send them.

One ``inferd serve`` (the prod overlay, the packaged MiniLM, torch, no result cache: every text is computed) with
gRPC on. Phases, taking turns each round (a shared machine's load drifts):

- ``http``: POST /embed, one text per request, ``--concurrency`` requests in flight (httpx, HTTP/1.1 keep-alive);
- ``grpc-unary``: Embed, one text per call, the same concurrency (grpc.aio, one channel);
- ``grpc-stream``: EmbedStream, one text per message, ``--streams`` streams each with at most ``--window``
  messages awaiting their answers (a message's latency: from its write to its answer);
- ``http-batch``: POST /embed with ``--batch`` texts per request at the same concurrency, the ceiling a client
  reaches by batching itself (its latency is the request's).

The client runs on the same machine as the server and competes with it for the cores: texts/s is the pair's,
the CPU per text is the server process's alone (psutil, user + system, every thread). The texts come from the
project's corpus (inferd/corpus.py), the same for every phase.

    .venv/bin/python bench/grpc_vs_http.py --quick        # 1 round x 4 phases x 15 s: about 2.5 min
    .venv/bin/python bench/grpc_vs_http.py                # 3 rounds x 4 phases x 30 s: about 7.5 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil

from inferd.bench.procs import free_port, start_inferd
from inferd.bench.stats import percentile
from inferd.corpus import texts as corpus_texts
from inferd.grpc.stubs import pb, rpc

PHASES = ("http", "grpc-unary", "grpc-stream", "http-batch")


class Texts:
    """The corpus, round and round: each call takes the next text (or the next ``n``)."""

    def __init__(self, pool: list[str]) -> None:
        self.pool, self.i = pool, 0

    def take(self, n: int = 1) -> list[str]:
        out = [self.pool[(self.i + k) % len(self.pool)] for k in range(n)]
        self.i += n
        return out


Result = tuple[int, list[float], int]  # texts answered, each answer's latency (s), calls refused


async def _closed(seconds: float, concurrency: int, one: Callable[[], Awaitable[int]]) -> Result:
    """``concurrency`` loops calling ``one`` (the texts it carried answered; 0: refused) until ``seconds`` pass."""
    end = time.perf_counter() + seconds
    latencies: list[float] = []
    done, refused = [0], [0]

    async def loop() -> None:
        while time.perf_counter() < end:
            t = time.perf_counter()
            n = await one()
            if n:
                done[0] += n
                latencies.append(time.perf_counter() - t)
            else:
                refused[0] += 1

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done[0], latencies, refused[0]


async def http_phase(url: str, texts: Texts, seconds: float, concurrency: int, batch: int) -> Result:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        async def one() -> int:
            sent = texts.take(batch)
            r = await client.post("/embed", json={"inputs": sent if batch > 1 else sent[0]})
            return len(sent) if r.status_code == 200 else 0
        return await _closed(seconds, concurrency, one)


async def grpc_unary_phase(target: str, texts: Texts, seconds: float, concurrency: int) -> Result:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = rpc.EmbedStub(channel)

        async def one() -> int:
            try:
                await stub.Embed(pb.EmbedRequest(inputs=texts.take()[0]))
            except grpc.aio.AioRpcError:
                return 0
            return 1
        return await _closed(seconds, concurrency, one)


async def grpc_stream_phase(target: str, texts: Texts, seconds: float, streams: int,
                            window: int) -> Result:
    end = time.perf_counter() + seconds
    latencies: list[float] = []
    done = [0]

    async def stream(stub: Any) -> None:
        sent: asyncio.Queue[float] = asyncio.Queue()
        room = asyncio.Semaphore(window)

        async def messages() -> Any:
            while time.perf_counter() < end:
                await room.acquire()
                sent.put_nowait(time.perf_counter())
                yield pb.EmbedRequest(inputs=texts.take()[0])

        async for _ in stub.EmbedStream(messages()):
            latencies.append(time.perf_counter() - sent.get_nowait())  # answers come in the messages' order
            done[0] += 1
            room.release()

    async with grpc.aio.insecure_channel(target) as channel:
        stub = rpc.EmbedStub(channel)
        await asyncio.gather(*(stream(stub) for _ in range(streams)))
    return done[0], latencies, 0  # a refused message ends its stream: the phase fails loudly


def run_phase(name: str, args: argparse.Namespace, url: str, target: str, texts: Texts,
              server: psutil.Process) -> dict[str, Any]:
    if name == "http":
        work = http_phase(url, texts, args.seconds, args.concurrency, 1)
    elif name == "http-batch":
        work = http_phase(url, texts, args.seconds, args.concurrency, args.batch)
    elif name == "grpc-unary":
        work = grpc_unary_phase(target, texts, args.seconds, args.concurrency)
    else:
        work = grpc_stream_phase(target, texts, args.seconds, args.streams, args.window)
    before, t0 = server.cpu_times(), time.perf_counter()
    count, latencies, refused = asyncio.run(work)
    wall, after = time.perf_counter() - t0, server.cpu_times()
    cpu = (after.user + after.system) - (before.user + before.system)
    ms = [x * 1e3 for x in latencies]
    return {"phase": name, "texts": count, "texts_per_s": count / wall, "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99), "server_cpu_ms_per_text": 1e3 * cpu / max(count, 1), "refused": refused}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in PHASES:
        mine = [r for r in rows if r["phase"] == name]
        if mine:
            out.append({"phase": name, **{k: statistics.median(r[k] for r in mine)
                                          for k in ("texts_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_text")}})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round of 15 s phases (about 2.5 min)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0, help="each phase's duration")
    p.add_argument("--concurrency", type=int, default=32, help="requests or calls in flight (http, grpc-unary)")
    p.add_argument("--streams", type=int, default=1, help="open EmbedStreams (grpc-stream)")
    p.add_argument("--window", type=int, default=64, help="messages per stream awaiting their answers")
    p.add_argument("--batch", type=int, default=32, help="texts per request (http-batch)")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--out", type=Path, default=None, help="write the rows and the summary as JSON here")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 15.0
    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}; choose from {list(PHASES)}")
    grpc_port = free_port()
    texts = Texts(corpus_texts(4000, 7))
    with tempfile.TemporaryDirectory() as tmp:
        server = start_inferd(Path(tmp), None, args.torch_threads,
                              {"INFERD__SERVER__GRPC_PORT": str(grpc_port), "INFERD__CACHE__MAX_ENTRIES": "0",
                               "INFERD__SERVER__ACCESS_LOG": "false"})
        try:
            proc = psutil.Process(server.proc.pid)
            target = f"127.0.0.1:{grpc_port}"
            asyncio.run(grpc_unary_phase(target, texts, 5.0, 4))  # warm-up: both listeners, the model's shapes
            asyncio.run(http_phase(server.url, texts, 5.0, 4, 32))
            rows = []
            for r in range(args.rounds):
                order = phases if r % 2 == 0 else phases[::-1]
                for name in order:
                    row = {"round": r, **run_phase(name, args, server.url, target, texts, proc)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            server.stop()
    table = summary(rows)
    print(f"\n{'phase':<12} {'texts/s':>9} {'P50 ms':>8} {'P99 ms':>8} {'server CPU ms/text':>19}")
    for row in table:
        print(f"{row['phase']:<12} {row['texts_per_s']:>9.1f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
              f"{row['server_cpu_ms_per_text']:>19.3f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                        "summary": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
