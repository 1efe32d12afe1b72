"""Which models late chunking refuses, and why (core/late_chunking.py refusal): read from a load's description
alone, before any work. The HTTP answer (422 late_chunking_unsupported) is tests/integration/test_late_chunking.py's."""

from __future__ import annotations

from typing import Any

import pytest

from inferd.core.description import ModelDescription
from inferd.core.late_chunking import refusal


def described(**facts: Any) -> ModelDescription:
    pooling = facts.pop("pooling", "mean")
    outputs = facts.pop("outputs", ["dense", "token_states"])
    return ModelDescription("m", "1", 1, "", facts.pop("task", "embedding"), pooling=pooling, normalize=True,
                            facts={"outputs": outputs, **facts})


@pytest.mark.parametrize("pooling", ["mean", "max", "mean_sqrt_len_tokens", "mean+max"])
def test_a_pooling_of_a_span_s_tokens_can_late_chunk(pooling: str) -> None:
    assert refusal(described(pooling=pooling)) is None


@pytest.mark.parametrize(("description", "says"), [
    (described(pooling="cls"), "pooling 'cls' takes the first token, which saw the whole window"),
    (described(pooling="lasttoken"), "pooling 'lasttoken' takes the last token"),
    (described(pooling="mean+weightedmean"), "pooling 'weightedmean' weighs tokens by their position"),
    (described(outputs=["multivector"]), "gives no token states to pool per piece (it gives multivector)"),
    (described(dense=["2_Dense: 384->256 Tanh"]), "its Dense layers after pooling run inside the model"),
    (described(task="rerank", outputs=None), "it is a rerank model, not an embedder"),
])
def test_a_model_that_cannot_is_refused_naming_why(description: ModelDescription, says: str) -> None:
    refused = refusal(description)
    assert refused is not None and says in refused.message
    assert refused.code == "late_chunking_unsupported" and refused.field == "chunking.mode"


def test_late_chunking_answers_dense_vectors_only() -> None:
    refused = refusal(described(), ("sparse",))
    assert refused is not None and "dense vector" in refused.message
