"""The real all-MiniLM-L6-v2 unpadded: the same outputs as the padded torch forward pass, batch invariant."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from inferd.core.backends.torch import TorchRunner
from inferd.core.backends.varlen import VarlenRunner
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.core.tasks.embedding import EmbeddingHandler
from inferd.corpus import texts as corpus_texts
from inferd.settings import ModelSettings, resolve_model_path

pytestmark = pytest.mark.model

CPU = torch.device("cpu")
MIXED = corpus_texts(32, seed=7)  # English, Chinese and mixed, 5 to 250 tokens
AT_LIMIT = [" ".join(corpus_texts(12, seed=s)) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def handler() -> Iterator[EmbeddingHandler]:
    h = load_handler(ModelSpec(path=resolve_model_path(ModelSettings()), name="minilm", version="1", device="cpu",
                               warmup=False))
    yield h  # type: ignore[misc]
    h.close()


@pytest.fixture(scope="module")
def padded(handler: EmbeddingHandler) -> TorchRunner:
    """transformers' own forward pass over the padded batch: the reference."""
    return TorchRunner(handler.runner.model, CPU)


@pytest.fixture(scope="module")
def padded_outputs(handler: EmbeddingHandler, padded: TorchRunner) -> dict[str, np.ndarray]:
    """The reference's outputs at every shape, computed once for the fp32 and bf16 comparisons."""
    return {name: handler.forward(padded, batch) for name, batch in shapes(handler).items()}


def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def shapes(h: EmbeddingHandler) -> dict[str, list]:
    return {"1 text": h.preprocess(MIXED[:1]), "32 mixed": h.preprocess(MIXED),
            "at the limit": h.preprocess([*AT_LIMIT, MIXED[0]])}


def test_the_texts_cover_the_shapes(handler: EmbeddingHandler) -> None:
    tokens = [e.tokens for e in handler.preprocess(MIXED)]
    assert min(tokens) < 20 and max(tokens) > 100
    assert {e.tokens for e in handler.preprocess(AT_LIMIT)} == {handler.max_seq_length}


def test_the_torch_backend_runs_minilm_unpadded_by_default(handler: EmbeddingHandler) -> None:
    assert isinstance(handler.runner, VarlenRunner) and handler.runner.capabilities.pads is False
    info = handler.loaded.backend_info
    assert info["unpadded"] is True and info["unpadded_reason"].startswith("auto")


def test_fp32_matches_the_padded_forward_at_every_shape(handler: EmbeddingHandler, padded: TorchRunner,
                                                        padded_outputs: dict[str, np.ndarray]) -> None:
    runner = VarlenRunner(handler.runner.model, CPU)
    for name, batch in shapes(handler).items():
        assert cos(padded_outputs[name], handler.forward(runner, batch)).min() >= 0.9999, name
    ids, mask, _ = handler.collate(shapes(handler)["32 mixed"])
    keep = mask.bool()
    torch.testing.assert_close(runner(ids, mask)[keep], padded(ids, mask)[keep], rtol=1e-3, atol=1e-4)


def test_a_text_gets_the_same_output_alone_and_among_31_others(handler: EmbeddingHandler) -> None:
    runner = VarlenRunner(handler.runner.model, CPU)
    batch = handler.preprocess(MIXED)
    together = handler.forward(runner, batch)
    alone = np.stack([handler.forward(runner, [e])[0] for e in batch])
    assert cos(alone, together).min() >= 0.99999


def test_bf16_autocast_passes_the_half_gate_threshold(handler: EmbeddingHandler,
                                                      padded_outputs: dict[str, np.ndarray]) -> None:
    runner = VarlenRunner(handler.runner.model, CPU, "bfloat16")
    for name, batch in shapes(handler).items():
        assert cos(padded_outputs[name], handler.forward(runner, batch)).min() >= 0.9995, name
