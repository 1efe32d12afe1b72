"""A document's pieces in the engine (core/pieces.py), over a fake handler that counts a token per character and
splits with the tiny model's tokenizer: the pieces run in waves through the normal scheduler (no batch larger
than the model's rules, no wave larger than its queue), a tenant is admitted once for a whole document (its
max_concurrent of 1 and its request rate hold for the request, not for each wave) and charged every piece's
tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from enginekit import EngineKit
from fakes import HashHandler, vector_for
from settingskit import make_settings
from tinymodel import WORDS
from tokenizers import Tokenizer

from inferd.core.chunking import Chunking
from inferd.core.errors import EngineError, Kind
from inferd.core.tenants import Tenancy

MAX_QUEUE = 6
MAX_BATCH = 2


def test_a_document_runs_in_waves_admitted_once_and_charged_per_piece(tmp_path: Path, tiny_model: Path) -> None:
    handler = HashHandler()
    handler.tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    handler.max_seq_length = 12
    settings = make_settings(
        tmp_path, batching={"max_queue": MAX_QUEUE, "max_batch_size": MAX_BATCH},
        server={"tenants": [{"name": "a", "keys": ["k"], "max_concurrent": 1, "requests_per_second": 1,
                             "tokens_per_minute": 1_000_000}]})
    kit = EngineKit(settings, handler)
    tenant = Tenancy(settings).resolve("k")
    text = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(200))
    engine = kit.engine

    async def scenario() -> tuple:
        request = engine.request([text], tenant=tenant, chunking=Chunking("pieces", max_tokens=10))
        return await engine.process(request)

    result = kit.run(scenario)
    (doc,) = result.outputs
    pieces = [text[p.start:p.end] for p in doc.pieces]
    assert len(pieces) > 3 * MAX_QUEUE  # many waves, each within the queue
    # Every piece ran as its own input, in batches no larger than the model's rule.
    ran = [t for batch in handler.batches for t in batch]
    assert sorted(ran) == sorted(pieces)
    assert max(map(len, handler.batches)) <= MAX_BATCH
    np.testing.assert_allclose(np.stack(doc.outputs), [vector_for(p) for p in pieces])
    # One request of the tenant's (a second wave would have been refused by max_concurrent 1, or by the rate of
    # one request a second), charged the tokens of every piece: a token per character here.
    assert tenant.in_flight == 0
    charged = tenant.report()["models"][engine.registry.names()[0]]["tokens"]
    assert charged == sum(map(len, pieces)) == result.prompt_tokens


def test_a_tenant_over_its_limits_is_refused_before_its_documents_are_split(tmp_path: Path, tiny_model: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A document's split (its tokenising, in one of limits.preprocess_concurrency places every tenant shares) is
    work for an admitted request only: a tenant past its request rate had each long document split, holding a
    place another tenant's document waited for, before its 429."""
    handler = HashHandler()
    handler.tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    handler.max_seq_length = 12
    settings = make_settings(tmp_path, server={"tenants": [{"name": "a", "keys": ["k"], "requests_per_second": 1}]})
    kit = EngineKit(settings, handler)
    tenant = Tenancy(settings).resolve("k")
    engine = kit.engine
    splits: list[int] = []
    real = engine.documents._split
    monkeypatch.setattr(engine.documents, "_split", lambda texts, *a: splits.append(len(texts)) or real(texts, *a))
    text = " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(60))

    async def scenario() -> EngineError:
        request = engine.request([text], tenant=tenant, chunking=Chunking("pieces", max_tokens=10))
        await engine.process(request)  # the rate's one request this second
        with pytest.raises(EngineError) as refused:
            await engine.process(request)
        return refused.value

    refused = kit.run(scenario)
    assert refused.kind is Kind.RATE_LIMITED and refused.code == "rate_limit_exceeded"
    assert splits == [1]  # the admitted request's document only
    assert tenant.in_flight == 0 and tenant.report()["refused"] == {"requests_per_second": 1}
