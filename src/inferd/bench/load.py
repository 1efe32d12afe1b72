"""The load generator: asyncio, run in the benchmark's process (never in a server's); see bench.http.

Closed loop: ``concurrency`` virtual users, each sending its next request as soon as the previous one is
answered, for ``duration`` seconds. Open loop: requests are *scheduled* at Poisson arrival times for a
fixed rate, whatever the server does, and each latency is measured from its scheduled send time; a server
(or client) stall therefore shows up as latency instead of silently lowering the offered load (the
"coordinated omission" that closed-loop tools hide).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from inferd.bench.http import CLIENT_ERRORS, HTTPClient, make_client
from inferd.bench.stats import latency_summary, parse_metrics, server_figures


class TextSource:
    """Hands out corpus texts in a seeded shuffled order, cycling; knows each text's real token count."""

    def __init__(self, texts: Sequence[str], tokens: Sequence[int], seed: int = 0) -> None:
        if len(texts) != len(tokens) or not texts:
            raise ValueError("texts and tokens must be non-empty and of equal length")
        self.texts, self.tokens = list(texts), list(tokens)
        self._order = list(range(len(texts)))
        random.Random(seed).shuffle(self._order)
        self._pos = 0

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(self._order[self._pos])
            self._pos = (self._pos + 1) % len(self._order)
        return out


@dataclass
class Samples:
    """What the client saw in one phase."""

    latencies: list[float] = field(default_factory=list)  # seconds, answered requests only
    requests: int = 0
    ok_texts: int = 0
    real_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    started: float = 0.0
    finished: float = 0.0
    late_sends: int = 0  # open loop: sends more than 10 ms behind schedule (the client fell behind)

    @property
    def elapsed(self) -> float:
        return max(self.finished - self.started, 1e-9)


class Target:
    """One server under test: its base URL, the JSON body shape it takes, the client kind to load it with."""

    def __init__(self, url: str, path: str = "/predict", field_name: str = "texts", client: str = "lean",
                 query: str | None = None, extra: dict[str, Any] | None = None, api_key: str | None = None) -> None:
        self.url, self.path, self.field, self.client = url.rstrip("/"), path, field_name, client
        # A rerank target: every request sends this query with its texts as documents (one pair each).
        self.query = query
        # Fields every request carries besides (another server's "model" name, say).
        self.extra = dict(extra or {})
        self.api_key = api_key


async def _send(client: HTTPClient, target: Target, source: TextSource, ids: list[int],
                samples: Samples, t0: float) -> None:
    fields: dict[str, Any] = {**target.extra, target.field: [source.texts[i] for i in ids]}
    if target.query is not None:
        fields["query"] = target.query
    body = orjson.dumps(fields)
    samples.requests += 1
    try:
        status, payload = await client.request("POST", target.path, body)
    except CLIENT_ERRORS as exc:
        samples.errors[type(exc).__name__] += 1
        return
    done = time.perf_counter()
    if status != 200:
        samples.errors[str(status)] += 1
        return
    # Check the answer's shape, cheaply: one vector per text sent (a server that drops texts is wrong).
    try:
        parsed = orjson.loads(payload)
        # inferd's /predict answers "results"; OpenAI-shaped servers (infinity's /embeddings) answer "data".
        results = parsed.get("results", parsed.get("data"))
    except (orjson.JSONDecodeError, AttributeError):
        results = None
    if not isinstance(results, list) or len(results) != len(ids):
        samples.errors["wrong_result_count"] += 1
        return
    samples.latencies.append(done - t0)
    samples.ok_texts += len(ids)
    samples.real_tokens += sum(source.tokens[i] for i in ids)
    samples.finished = max(samples.finished, done)


async def closed_loop(client: HTTPClient, target: Target, source: TextSource, concurrency: int,
                      texts_per_request: int, duration: float) -> Samples:
    samples = Samples(started=time.perf_counter())
    samples.finished = samples.started
    stop = samples.started + duration

    async def user() -> None:
        while time.perf_counter() < stop:
            await _send(client, target, source, source.take(texts_per_request), samples, time.perf_counter())

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return samples


async def open_loop(client: HTTPClient, target: Target, source: TextSource, rate: float,
                    duration: float, seed: int = 0) -> Samples:
    """Poisson arrivals at ``rate`` requests/s (one text each) for ``duration`` seconds."""
    rng = random.Random(seed)
    samples = Samples(started=time.perf_counter() + 0.01)
    samples.finished = samples.started
    scheduled = samples.started
    tasks: list[asyncio.Task[None]] = []
    while True:
        scheduled += rng.expovariate(rate)
        if scheduled - samples.started > duration:
            break
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -0.01:
            samples.late_sends += 1
        tasks.append(asyncio.create_task(_send(client, target, source, source.take(1), samples, scheduled)))
    await asyncio.gather(*tasks)
    return samples


async def scrape(client: HTTPClient) -> dict[str, float] | None:
    """inferd's histogram sums and counts; None for a server without /metrics (the naive baseline)."""
    try:
        status, payload = await client.request("GET", "/metrics")
    except CLIENT_ERRORS:
        return None
    return parse_metrics(payload.decode("utf-8", "replace")) if status == 200 else None


def summarise(samples: Samples, before: dict[str, float] | None, after: dict[str, float] | None,
              client_cpu_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": samples.requests, "ok_requests": len(samples.latencies), "texts": samples.ok_texts,
        "errors": dict(samples.errors), "elapsed_s": round(samples.elapsed, 3),
        "texts_per_s": round(samples.ok_texts / samples.elapsed, 2),
        "requests_per_s": round(len(samples.latencies) / samples.elapsed, 2),
        **latency_summary(samples.latencies),
        "real_tokens": samples.real_tokens,
        "client_cpu_share": round(client_cpu_s / samples.elapsed, 3),
        "late_sends": samples.late_sends,
    }
    figures = server_figures(before, after, samples.real_tokens, samples.elapsed) if before and after else {}
    out.update({"mean_batch_size": None, "padding_efficiency": None, **figures})
    return out


async def _phase(target: Target, make: Callable[[HTTPClient], Coroutine[Any, Any, Samples]],
                 warm: Callable[[HTTPClient], Coroutine[Any, Any, Samples]] | None,
                 connections: int) -> dict[str, Any]:
    client = make_client(target.client, target.url, connections, target.api_key)
    try:
        if warm is not None:
            await warm(client)  # fills connection pools and the server's caches; not counted
        before = await scrape(client)
        cpu0 = time.process_time()
        samples = await make(client)
        cpu = time.process_time() - cpu0
        after = await scrape(client)
    finally:
        await client.aclose()
    return summarise(samples, before, after, cpu)


def _run(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    try:
        import uvloop  # a cheaper event loop leaves more of the shared CPU to the server under test
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def run_closed(target: Target, source: TextSource, concurrency: int, texts_per_request: int,
               duration: float, warmup: float) -> dict[str, Any]:
    def make(d: float) -> Callable[[HTTPClient], Coroutine[Any, Any, Samples]]:
        return lambda c: closed_loop(c, target, source, concurrency, texts_per_request, d)

    result = _run(_phase(target, make(duration), make(warmup) if warmup > 0 else None, concurrency))
    result.update({"concurrency": concurrency, "texts_per_request": texts_per_request})
    return result


def run_open(target: Target, source: TextSource, rate: float, duration: float, warmup: float,
             seed: int = 0) -> dict[str, Any]:
    def warm(c: HTTPClient) -> Coroutine[Any, Any, Samples]:
        return open_loop(c, target, source, rate, warmup, seed + 1)

    result = _run(_phase(target, lambda c: open_loop(c, target, source, rate, duration, seed),
                         warm if warmup > 0 else None, 4096))
    result.update({"offered_rate": round(rate, 2), "texts_per_request": 1})
    return result
