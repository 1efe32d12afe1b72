"""Dynamic batching through a real server: a deterministic fake handler, and the tiny model.

The fake (tests/fakes.py, ``fakes:HashHandler``) answers each text with a vector computed from that text
alone and records every batch it computes in a file, so a test can see what ran together and what never
ran. A ``hold:NAME`` text keeps the worker busy until the test creates the gate file NAME: whatever is
sent meanwhile is provably queued.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import Server
from enginekit import until
from fakes import read_record, vector_for
from prometheus_client.parser import text_string_to_metric_families
from tinymodel import WORDS

MAX_BATCH = 8
MAX_QUEUE = 256


@dataclass
class Fake:
    server: Server
    record: Path
    gates: Path

    def computed(self) -> set[str]:
        return {t for batch in read_record(self.record) for t in batch}


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Fake:
    tmp = tmp_path_factory.mktemp("batching")
    (tmp / "gates").mkdir()
    (tmp / "model").mkdir()
    server = module_serve({
        "INFERD__MODEL__TASK": "fakes:HashHandler",
        "INFERD__MODEL__PATH": str(tmp / "model"),
        "INFERD__BATCHING__MAX_BATCH_SIZE": str(MAX_BATCH),
        "INFERD__BATCHING__MAX_QUEUE": str(MAX_QUEUE),
        "INFERD__BATCHING__MAX_WAIT_MS": "5",
        # These tests are about sharing batches, whatever the lengths; padding has its own scheduler tests.
        "INFERD__BATCHING__MIN_PADDING_EFFICIENCY": "0",
        "FAKE_RECORD": str(tmp / "record.jsonl"),
        "FAKE_GATE_DIR": str(tmp / "gates"),
    }, wait="/health/ready")
    return Fake(server, tmp / "record.jsonl", tmp / "gates")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def metric(c: httpx.AsyncClient, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` that carry these labels (whatever their others, e.g. the model)."""
    r = await c.get("/metrics")
    wanted = set(labels.items())
    return sum(v for (n, got), v in samples(r.text).items() if n == name and wanted <= set(got))


def client(fake: Fake, timeout: float = 30.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    return httpx.AsyncClient(base_url=fake.server.url, timeout=timeout, limits=limits)


class Hold:
    """The worker busy with one batch until ``release``; requests sent meanwhile stay queued."""

    def __init__(self, fake: Fake, c: httpx.AsyncClient) -> None:
        self.fake, self.name = fake, uuid.uuid4().hex
        self.text = f"hold:{self.name}"
        self.request = asyncio.ensure_future(c.post("/predict", json={"texts": [self.text]}))

    async def started(self) -> None:
        async def running() -> bool:
            return self.text in self.fake.computed()

        await until(running, 20, "the held batch to start", every=0.01)

    async def release(self) -> None:
        (self.fake.gates / self.name).touch()
        r = await self.request
        assert r.status_code == 200 and r.json()["results"] == [vector_for(self.text)]


async def queue_depth_is(c: httpx.AsyncClient, n: int) -> None:
    async def check() -> bool:
        return await metric(c, "inferd_queue_depth") == n

    await until(check, 20, f"{n} queued texts", every=0.01)


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def texts_of(prefix: str, n: int) -> list[str]:
    # Varied lengths (the fake's token count is the length), so length grouping reorders items.
    return [f"{prefix}-{i}-" + "x" * ((i * 37) % 50) for i in range(n)]


def test_concurrent_requests_each_get_their_own_result_in_shared_batches(fake: Fake):
    tag = uuid.uuid4().hex[:8]
    texts = texts_of(f"c{tag}", 200)

    async def scenario() -> list[httpx.Response]:
        async with client(fake) as c:
            batched_before = await metric(c, "inferd_batch_size_count", version="1") - await metric(
                c, "inferd_batch_size_bucket", version="1", le="1.0")
            hold = Hold(fake, c)
            await hold.started()
            requests = [asyncio.ensure_future(c.post("/predict", json={"texts": [t]})) for t in texts]
            await queue_depth_is(c, len(texts))
            await hold.release()
            responses = await asyncio.gather(*requests)
            batched = await metric(c, "inferd_batch_size_count", version="1") - await metric(
                c, "inferd_batch_size_bucket", version="1", le="1.0")
            assert batched - batched_before >= len(texts) // MAX_BATCH
            return responses

    responses = run(scenario)
    for text, r in zip(texts, responses, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["results"] == [vector_for(text)]
    ours = [b for b in read_record(fake.record) if any(t.startswith(f"c{tag}") for t in b)]
    assert {t for b in ours for t in b} == set(texts)
    assert all(1 < len(b) <= MAX_BATCH for b in ours)


def test_multi_text_requests_are_split_into_items_and_reassembled_in_order(fake: Fake):
    tag = uuid.uuid4().hex[:8]
    predict = texts_of(f"p{tag}", 13)
    openai = texts_of(f"o{tag}", 11)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with client(fake) as c:
            hold = Hold(fake, c)
            await hold.started()
            p = asyncio.ensure_future(c.post("/predict", json={"texts": predict}))
            o = asyncio.ensure_future(c.post("/v1/embeddings", json={"input": openai}))
            await queue_depth_is(c, len(predict) + len(openai))
            await hold.release()
            return await p, await o

    p, o = run(scenario)
    assert p.status_code == 200 and o.status_code == 200, (p.text, o.text)
    assert p.json()["results"] == [vector_for(t) for t in predict]
    data = o.json()["data"]
    assert [d["index"] for d in data] == list(range(len(openai)))
    assert [d["embedding"] for d in data] == [vector_for(t) for t in openai]
    ours = [b for b in read_record(fake.record) if any(tag in t for t in b)]
    # 24 items in batches of at most 8: each request was split, and the two shared a batch.
    assert all(len(b) <= MAX_BATCH for b in ours) and len(ours) >= 3
    assert any({t[0] for t in b} == {"p", "o"} for b in ours)


def test_a_full_queue_answers_503_with_retry_after_and_every_accepted_request_completes(fake: Fake):
    tag = uuid.uuid4().hex[:8]
    chunks = [texts_of(f"f{tag}{k}", MAX_QUEUE // 4) for k in range(4)]

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, float]:
        async with client(fake) as c:
            overloaded_before = await metric(c, "inferd_requests_rejected_total", reason="overloaded")
            hold = Hold(fake, c)
            await hold.started()
            accepted = [asyncio.ensure_future(c.post("/predict", json={"texts": t})) for t in chunks]
            await queue_depth_is(c, MAX_QUEUE)
            refused = await c.post("/predict", json={"texts": [f"f{tag} one too many"]})
            overloaded = await metric(c, "inferd_requests_rejected_total", reason="overloaded")
            await hold.release()
            return list(await asyncio.gather(*accepted)), refused, overloaded - overloaded_before

    accepted, refused, overloaded = run(scenario)
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert set(refused.json()["error"]) == {"message", "type", "code", "param"}
    assert overloaded == 1
    for chunk, r in zip(chunks, accepted, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["results"] == [vector_for(t) for t in chunk]
    assert f"f{tag} one too many" not in fake.computed()


def test_a_deadline_passing_in_the_queue_answers_504_and_is_never_computed(fake: Fake):
    late = f"deadline {uuid.uuid4().hex}"

    async def scenario() -> tuple[httpx.Response, float]:
        async with client(fake) as c:
            before = await metric(c, "inferd_requests_rejected_total", reason="deadline")
            hold = Hold(fake, c)
            await hold.started()
            # Answered while the worker is still busy: the deadline, not the worker, ends the wait.
            r = await c.post("/predict", json={"texts": [late], "timeout_ms": 100})
            counted = await metric(c, "inferd_requests_rejected_total", reason="deadline") - before
            await hold.release()
            return r, counted

    r, counted = run(scenario)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    assert counted == 1
    assert late not in fake.computed()


def test_a_client_that_disconnects_while_queued_is_never_computed(fake: Fake):
    victim = f"victim {uuid.uuid4().hex}"

    async def scenario() -> float:
        async with client(fake) as c:
            gone_before = await metric(c, "inferd_requests_rejected_total", reason="disconnected")
            left_before = await metric(c, "inferd_requests_total", endpoint="/predict", status="499")
            hold = Hold(fake, c)
            await hold.started()
            async with client(fake) as impatient:
                request = asyncio.ensure_future(impatient.post("/predict", json={"texts": [victim]}))
                await queue_depth_is(c, 1)
                request.cancel()  # the client gives up while its text is provably queued
                with pytest.raises(asyncio.CancelledError):
                    await request

            async def noticed() -> bool:  # the server saw the client leave (it answers 499 into the void)
                return await metric(c, "inferd_requests_total", endpoint="/predict", status="499") > left_before

            await until(noticed, 20, "the server to notice the disconnect", every=0.01)
            await hold.release()

            async def dropped() -> bool:
                return await metric(c, "inferd_requests_rejected_total", reason="disconnected") > gone_before

            await until(dropped, 20, "the dropped item to be counted", every=0.01)
            return await metric(c, "inferd_requests_rejected_total", reason="disconnected") - gone_before

    assert run(scenario) == 1
    assert victim not in fake.computed()


def test_a_failing_batch_fails_its_requests_and_the_worker_carries_on(fake: Fake):
    with fake.server.client() as c:
        r = c.post("/predict", json={"texts": ["fail: on purpose"]})
        assert r.status_code == 500
        err = r.json()["error"]
        assert set(err) == {"message", "type", "code", "param"} and err["code"] == "inference_error"
        assert "Traceback" not in r.text and "RuntimeError" not in r.text
        assert c.get("/health/live").status_code == 200
        assert c.get("/health/ready").status_code == 200
        after = c.post("/predict", json={"texts": ["after the failure"]})
        assert after.status_code == 200 and after.json()["results"] == [vector_for("after the failure")]


# -- the tiny model: batching must not change the numbers -------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(tiny_model),
        "INFERD__BATCHING__MAX_BATCH_SIZE": str(MAX_BATCH),
    }, wait="/health/ready")


def test_batched_results_equal_single_request_results(tiny: Server):
    # Mixed lengths (2 to 40 words, some Chinese): batches are padded, so the mask must hide the padding.
    texts = [" ".join(WORDS[(i * 7) % len(WORDS):][: 2 + (i * 11) % 39]) for i in range(20)]
    texts += ["我们的模型", "这是一个很长的中文句子，用来测试填充"]
    with tiny.client() as c:
        singles = []
        for t in texts:
            r = c.post("/predict", json={"texts": [t]})
            assert r.status_code == 200, r.text
            singles.append(r.json()["results"][0])
        before = samples(c.get("/metrics").text)
        together = c.post("/predict", json={"texts": texts})
        assert together.status_code == 200, together.text
        after = samples(c.get("/metrics").text)

    def multi(s: dict[tuple[str, tuple], float]) -> float:
        key = (("model", "all-MiniLM-L6-v2"), ("version", "1"))
        return s[("inferd_batch_size_count", key)] - s[("inferd_batch_size_bucket", (("le", "1.0"), *key))]

    assert multi(after) - multi(before) >= len(texts) // MAX_BATCH  # the request really ran in batches

    async def concurrent() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tiny.url, timeout=30) as ac:
            return await asyncio.gather(*(ac.post("/predict", json={"texts": [t]}) for t in texts))

    crowd = [r.json()["results"][0] for r in run(concurrent)]
    np.testing.assert_allclose(np.array(together.json()["results"]), np.array(singles), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(crowd), np.array(singles), rtol=0, atol=1e-5)
