"""The accuracy gate judges sparse and token-vector outputs (issue 32) and can fail on each: a candidate whose
heaviest terms differ, whose weights drift, whose token vectors rank other texts otherwise, or which answers NaN,
is refused naming the figure and its setting; a faithful one passes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from inferd.core.backends import gate, gate_figures, gate_verdict
from inferd.core.preprocess import Encoded
from inferd.settings import GateSettings

VOCAB, DIM = 64, 8


class GatedTask:
    """Texts tokenised by character; each output a fixed function of the ids, changed by ``runner``'s fault."""

    task = "embedding"
    max_seq_length = 48
    multi_label = False
    outputs = ("sparse", "multivector")

    def preprocess(self, texts: list[Any]) -> list[Encoded]:
        return [Encoded([ord(c) % VOCAB for c in str(t)][: self.max_seq_length] or [1], False) for t in texts]

    def collate(self, batch: list[Encoded]) -> Any:
        raise NotImplementedError

    def forward(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        raise NotImplementedError

    def head_module(self, model: torch.nn.Module) -> None:
        return None

    def forward_outputs(self, runner: Any, batch: list[Encoded]) -> dict[str, list[Any]]:
        sparse, tokens = [], []
        for e in batch:
            ids = np.array(e.ids)
            weights = np.zeros(VOCAB)
            np.maximum.at(weights, ids, 1.0 + (ids % 7) / 7.0 + np.arange(len(ids)) / 100.0)
            vectors = np.stack([np.cos(ids * (k + 1) / 5.0) for k in range(DIM)], axis=1)
            weights, vectors = runner(weights, vectors)
            nz = np.flatnonzero(weights)
            sparse.append((nz, weights[nz]))
            tokens.append(vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
        return {"sparse": sparse, "multivector": tokens}


def exact(w: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return w, v


def judged(candidate: Any) -> list[str]:
    texts = [f"text {i} " + "abcdefghij"[i % 10] * (i % 13 + 1) + "xyz"[i % 3] * (i % 5) for i in range(40)]
    figures = gate.measure(GatedTask(), exact, candidate, texts)  # type: ignore[arg-type]
    return gate_verdict.judge(figures, "fp32", GateSettings())


def test_a_faithful_candidate_passes() -> None:
    assert judged(lambda w, v: (w * (1 + 1e-7), v)) == []


def test_other_heaviest_terms_and_drifted_weights_are_refused() -> None:
    def flatten(w: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.where(w > 0, 1.0 + (np.arange(VOCAB) % 3) / 10, 0.0), v  # the ranking of terms is another

    failures = judged(flatten)
    assert any("sparse top-10 term agreement" in f and "sparse_top10_min" in f for f in failures)
    assert any("sparse weight diff" in f and "fp32_score_diff_max" in f for f in failures)


def test_token_vectors_that_rank_the_texts_otherwise_are_refused() -> None:
    rng = np.random.default_rng(0)

    def scramble(w: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return w, rng.normal(size=v.shape)

    failures = judged(scramble)
    assert any("maxsim_spearman_min" in f for f in failures)


def test_a_nan_output_fails_whatever_the_figures() -> None:
    def nan_once(w: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = w.copy()
        if w[32] > 0:  # the space's id: in every text
            w[32] = np.nan
        return w, v

    failures = judged(nan_once)
    assert failures and "not finite" in failures[0]


@pytest.mark.parametrize("figure", ["sparse_top10", "maxsim_spearman"])
def test_a_nan_figure_is_no_pass(figure: str) -> None:
    figures = gate_figures.GateFigures(cosine_min=1.0, cosine_mean=1.0, overlap_at_10=None, invariance_min=1.0, texts=4,
                               shapes={}, sparse_top10=1.0, weight_diff_max=0.0, maxsim_spearman=1.0,
                               maxsim_top3=1.0)
    figures = gate_figures.GateFigures.from_dict({**figures.as_dict(), figure: float("nan")})
    assert gate_verdict.judge(figures, "fp32", GateSettings())
