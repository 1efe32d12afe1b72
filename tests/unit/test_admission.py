"""core/admission.py through the one engine call, in-process with fake handlers (no HTTP, no weights): which model
load a request runs on (a name, a pinned version, the canary's share), what that load's description decides (its
prompt), and how a route shapes the result (api/vectors.py) from the description that travels with it."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from enginekit import EngineKit, per_load
from fakes import DIM, HashHandler, vector_for
from settingskit import make_settings

from inferd.api import vectors
from inferd.core import admission
from inferd.core.admission import token_estimate
from inferd.core.description import Loaded, TaskFacts
from inferd.core.engine import InferenceEngine
from inferd.core.errors import EngineError, Kind
from inferd.core.outcomes import TaskResult
from inferd.core.preprocess import Encoded
from inferd.core.prompts import Prompt
from inferd.core.spec import ModelSpec
from inferd.core.tenants import Tenancy, current_tenant
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions


class Prompted(HashHandler):
    """A fake embedder whose load describes its own prompts and normalisation (the folder's name says which)."""

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        canary = spec.path.name == "canary"
        self.prompts = {"query": "C: " if canary else "A: "}
        self.normalize = canary
        return super().load(spec, device)

    def facts(self) -> TaskFacts:
        return TaskFacts(dimension=DIM, prompts=self.prompts, normalize=self.normalize)


def with_canary(tmp_path: Path, scenario: Callable[[InferenceEngine, str], Awaitable[None]]) -> None:
    """An engine serving ``active`` (v1) and, once started, ``canary`` (v2) at weight 1: every unpinned request is
    the canary's."""
    for folder in ("active", "canary"):
        (tmp_path / folder).mkdir()
    kit = EngineKit(make_settings(tmp_path / "active", model={"version": "v1"}), per_load(lambda spec: Prompted()))
    engine = kit.engine
    name = engine.registry.names()[0]

    async def main() -> None:
        await asyncio.to_thread(engine.manager.set_canary, str(tmp_path / "canary"), "v2", 1.0, None, True)
        await scenario(engine, name)

    kit.run(main)


def test_the_canary_answers_with_its_own_prompt_and_its_description_travels_with_the_result(tmp_path: Path) -> None:
    async def scenario(engine: InferenceEngine, name: str) -> None:
        result = await engine.process(engine.request(["text"], task="embedding", prompt=Prompt("query")))
        # Prompted with the canary's prompt, by the load that ran it; shaped by that load's description.
        assert result.outputs == [vector_for("C: text")]
        assert (result.version, result.description.normalize, dict(result.description.prompts or {})) == (
            "v2", True, {"query": "C: "})
        # A pinned version runs on that load, whatever the canary's weight: name@version, or the bare version.
        for model in (f"{name}@v1", "v1"):
            pinned = await engine.process(engine.request(["text"], model=model, prompt=Prompt("query")))
            assert (pinned.outputs, pinned.version, pinned.description.normalize) == (
                [vector_for("A: text")], "v1", False)

    with_canary(tmp_path, scenario)


def test_a_request_the_served_models_cannot_answer_is_refused_naming_what_is_served(tmp_path: Path) -> None:
    async def scenario(engine: InferenceEngine, name: str) -> None:
        for request, kind, field in (
                (engine.request(["t"], model=f"{name}@v7"), Kind.MODEL_NOT_FOUND, "model"),
                (engine.request(["t"], model="elsewhere"), Kind.MODEL_NOT_FOUND, "model"),
                (engine.request(["t"], task="rerank"), Kind.WRONG_TASK, None),
                (engine.request(["t"], model=name, task="rerank"), Kind.MODEL_NOT_FOUND, "model"),
                (engine.request(["t"], prompt=Prompt("passage")), Kind.INVALID_INPUT, "prompt_name")):
            with pytest.raises(EngineError) as caught:
                await engine.process(request)
            assert (caught.value.kind, caught.value.field) == (kind, field), caught.value.message
        assert "v1 and v2" in (await _refusal(engine.process(engine.request(["t"], model=f"{name}@v7")))).message
        async with engine.hold() as slot:  # what TEI's /tokenize shows: the running load, held while it is read
            assert slot.description.version == "v2"
        with pytest.raises(EngineError) as caught:
            async with engine.hold("elsewhere"):
                pass
        assert caught.value.kind is Kind.MODEL_NOT_FOUND

    with_canary(tmp_path, scenario)


async def _refusal(call: Awaitable[Any]) -> EngineError:
    with pytest.raises(EngineError) as caught:
        await call
    return caught.value


def test_a_result_is_cut_and_quantised_by_the_description_it_carries(tmp_path: Path) -> None:
    async def scenario(engine: InferenceEngine, name: str) -> None:
        result = await engine.process(engine.request(["a", "b"], model=f"{name}@v1"))
        raw = np.asarray(result.outputs, dtype=np.float32)
        # The active model (normalize false) cuts its vectors as they are; the same numbers from a load that
        # normalises are renormalised after the cut, as that model's own smaller vectors would be.
        np.testing.assert_allclose(vectors.vectors_of(result, 4), raw[:, :4])
        unit = TaskResult(result.outputs, result.tokens, dataclasses.replace(result.description, normalize=True))
        cut = vectors.vectors_of(unit, 4)
        np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, rtol=1e-6)
        np.testing.assert_allclose(cut, raw[:, :4] / np.linalg.norm(raw[:, :4], axis=1, keepdims=True), rtol=1e-6)
        # int8 ranges come from the calibration vectors the result carries: those of the load that computed it.
        calibrated = await engine.process(engine.request(["a"], model=f"{name}@v1", calibrate=True))
        assert calibrated.calibration is not None and calibrated.calibration.shape[1] == DIM
        assert vectors.ranges_for(calibrated, 4).shape == (2, 4)

    with_canary(tmp_path, scenario)


class GatedTokenizer(HashHandler):
    """Tokenises only once ``gate`` is set: requests admitted meanwhile are all tokenising at once."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def preprocess(self, texts: list[str]) -> list[Encoded]:
        self.entered.set()
        assert self.gate.wait(20), "the test never opened the gate"
        return super().preprocess(texts)


def test_requests_tokenising_at_once_cannot_take_a_token_budget_past_one_request(tmp_path: Path) -> None:
    """Issue 39: 40 requests of one long text (tokenised in the thread pool) from a tenant with 1,000 tokens a
    minute were all admitted, each checked against a budget none had been charged yet; 5,000 tokens each, one fits
    (the budget goes below zero by at most one request)."""
    handler = GatedTokenizer()
    settings = make_settings(tmp_path, server={"tenants": [{"name": "a", "keys": ["k"], "tokens_per_minute": 1000}]})
    kit = EngineKit(settings, handler)
    engine = kit.engine
    tenant = Tenancy(settings).resolve("k")
    text = "long " * 1000  # 5,000 characters: past the size tokenised on the event loop

    async def main() -> list[Any]:
        sent = [asyncio.ensure_future(engine.process(engine.request([text], tenant=tenant))) for _ in range(40)]
        await asyncio.to_thread(handler.entered.wait, 20)
        for _ in range(10):  # every request admitted or refused before any is tokenised
            await asyncio.sleep(0)
        handler.gate.set()
        return await asyncio.gather(*sent, return_exceptions=True)

    answers = kit.run(main, timeout=40)
    done = [a for a in answers if isinstance(a, TaskResult)]
    refused = [a for a in answers if isinstance(a, EngineError)]
    assert len(done) == 1 and len(refused) == 39, [type(a) for a in answers]
    assert {(e.kind, e.code) for e in refused} == {(Kind.RATE_LIMITED, "rate_limit_exceeded")}
    assert tenant.report()["models"][engine.registry.names()[0]]["tokens"] == len(text)
    # One request's debt, nothing left reserved (a few seconds' refill at most).
    assert tenant.in_flight == 0 and tenant.tokens.refill(time.monotonic()) == pytest.approx(1000 - 5000, abs=100)


def test_a_request_is_charged_to_the_tenant_it_carries(tmp_path: Path) -> None:
    """Issue 40: the tenant travels in the request (InferenceRequest.tenant, set by the route as it builds it), not
    beside it in a context variable: a request built for tenant a is a's, whatever tenant the caller's context
    names (before, the field was refused unless a string and never read; the context's tenant was charged)."""
    settings = make_settings(tmp_path, server={"tenants": [{"name": "a", "keys": ["ka"]},
                                                           {"name": "b", "keys": ["kb"]}]})
    kit = EngineKit(settings, HashHandler())
    engine = kit.engine
    tenancy = Tenancy(settings)
    a, b = tenancy.resolve("ka"), tenancy.resolve("kb")
    assert a is not None and b is not None

    async def main() -> TaskResult:
        current_tenant.set(b)
        return await engine.process(engine.request(["hello world"], tenant=a))

    kit.run(main)
    name = engine.registry.names()[0]
    used = a.report()["models"][name]
    assert used["requests"] == 1 and used["tokens"] > 0
    assert b.report()["models"] == {} and a.in_flight == b.in_flight == 0


def test_a_request_reads_its_model_s_bound_from_the_model_resolved(tmp_path: Path) -> None:
    """Issue 40: the model is resolved once per request; admission looked it up again in the queue, under the
    queue's lock, for the bound on a request's texts (batching.max_queue), and the calibration for its step."""
    kit = EngineKit(make_settings(tmp_path), HashHandler())
    engine = kit.engine

    def looked_up(lane: str) -> int:
        raise AssertionError(f"the queue was asked for {lane!r}'s bound")

    async def main() -> TaskResult:
        request = engine.request(["a", "b", "c"], calibrate=True)  # the server's limits are the engine's own
        engine.queue.max_queue = looked_up  # type: ignore[method-assign]
        return await engine.process(request)

    result = kit.run(main)
    assert len(result.outputs) == 3 and result.calibration is not None


def test_a_reservation_is_estimated_from_characters_capped_at_the_window() -> None:
    # A token per character and the special tokens, a pair counting both texts, each input at most the window or
    # its own max_tokens.
    assert token_estimate(["abcd", "ef"], PLAIN_INPUTS, None) == (4 + 3) + (2 + 3)
    assert token_estimate([("query", "a document")], PLAIN_INPUTS, 512) == 5 + 10 + 3
    assert token_estimate(["x" * 5000, "short"], PLAIN_INPUTS, 512) == 512 + 5 + 3
    capped = InputOptions(TextOptions(max_tokens=64))
    assert token_estimate(["x" * 5000], capped, 512) == 64
    assert token_estimate(["x" * 5000], capped, None) == 64
    # Each input by its own options (one per input).
    each = InputOptions(each=(TextOptions(max_tokens=64), TextOptions()))
    assert token_estimate(["x" * 5000, "x" * 5000], each, 512) == 64 + 512


def test_admission_admits_and_composes_the_cache_the_calibration_and_the_shadow_mirror() -> None:
    """Issue 40: admission held four ideas in 507 lines (admitting and waiting, the cache merge, the int8
    calibration, shadow mirroring); it admits, queues and waits, and composes the others, each a unit of its own:
    the cache's part of a request (core/cache.py ResultCache.answer), core/calibration.py, core/shadow_mirror.py."""
    source = Path(admission.__file__).read_text(encoding="utf-8")
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert {"inferd.core.calibration", "inferd.core.shadow_mirror", "inferd.core.tokenizing"} <= imported
    assert not imported & {"inferd.core.quantize", "inferd.core.shadow"}  # what the two units hold
    assert len(source.splitlines()) <= 400
