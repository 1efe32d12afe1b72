"""The gate runs its costly batch shapes (mixed and padded batches of long rows) on a subset, with the same promise:
every input is still judged at its own length, every long document is in the subset, and what only padding does (a
wrong mask) is still caught. A fake probe and runners: no model, no runtime."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from inferd.core.backends import gate, gate_figures, gate_inputs, gate_shapes, gate_verdict
from inferd.core.preprocess import Encoded
from inferd.settings import GateSettings

DIM = 8
TEXTS = [f"text {i} " + "abcdefghij"[i % 10] * (i % 13 + 1) for i in range(64)]


class GatedTask:
    """Texts tokenised by character; a vector per text a fixed function of its ids, changed by the runner."""

    task = "embedding"
    max_seq_length = 48
    multi_label = False
    outputs = ("dense",)

    def preprocess(self, texts: list[Any]) -> list[Encoded]:
        return [Encoded([ord(c) % 97 for c in str(t)][: self.max_seq_length] or [1], False) for t in texts]

    def collate(self, batch: list[Encoded]) -> Any:
        raise NotImplementedError

    def head_module(self, model: torch.nn.Module) -> None:
        return None

    def forward_outputs(self, runner: Any, batch: list[Encoded]) -> dict[str, list[Any]]:
        raise NotImplementedError

    def forward(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        longest = max(e.tokens for e in batch)
        rows = []
        for e in batch:
            ids = np.array(e.ids, dtype=np.float64)
            rows.append(runner(np.array([np.cos(ids * (k + 1) / 7.0).sum() for k in range(DIM)]), e, longest))
        return np.stack(rows)


def exact(v: np.ndarray, e: Encoded, longest: int) -> np.ndarray:
    return v


def figures(candidate: Any) -> gate_figures.GateFigures:
    return gate.measure(GatedTask(), exact, candidate, TEXTS)  # type: ignore[arg-type, return-value]


def test_cheap_shapes_cover_every_input_and_costly_ones_every_long_document() -> None:
    probe = GatedTask()
    items = gate_inputs.encode_set(probe, TEXTS)
    long = {i for i, e in enumerate(items) if e.tokens == probe.max_seq_length}
    at_limit = set(range(gate_inputs.AT_LIMIT_SHARE - 1, len(items), gate_inputs.AT_LIMIT_SHARE))
    assert at_limit <= long
    for name in gate_shapes.plans(gate_inputs.BUILTIN_SEED):
        covered = set(gate_shapes.subset(len(items), name))
        assert covered == set(range(len(items))) if name not in gate_shapes.COSTLY else (
            at_limit <= covered and len(covered) == len(items) // gate_shapes.SUBSET_STEP)
    got = figures(exact)
    assert gate_verdict.judge(got, "fp32", GateSettings()) == []
    assert set(got.shapes) == {"1", "32 sorted", "32 mixed", gate_shapes.PADDED}
    # Neighbours are ranked over the whole set only, at the shapes that cover it.
    assert [got.shapes[n]["overlap_at_10"] is None for n in got.shapes] == [False, False, True, True]


def test_a_text_outside_the_subset_is_still_judged() -> None:
    """Input 0 is in no costly shape; a candidate wrong on it alone is refused from the cheap shapes."""
    assert 0 not in gate_shapes.subset(len(TEXTS), gate_shapes.PADDED)
    first = GatedTask().preprocess([TEXTS[0]])[0].ids

    def wrong_on_first(v: np.ndarray, e: Encoded, longest: int) -> np.ndarray:
        return -v if e.ids == first else v

    got = figures(wrong_on_first)
    assert got.cosine_min < 0 and gate_verdict.judge(got, "fp32", GateSettings())
    assert got.shapes["1"]["cosine_min"] < 0 and got.shapes["32 sorted"]["cosine_min"] < 0


def test_a_wrong_mask_is_caught_on_the_subset() -> None:
    """Rows padded to a longer input drift (what a wrong mask does): only the mixed and padded shapes see it."""

    def padding_leaks(v: np.ndarray, e: Encoded, longest: int) -> np.ndarray:
        return v + (longest - e.tokens) * 0.05

    got = figures(padding_leaks)
    refused = gate_verdict.judge(got, "fp32", GateSettings())
    assert refused and got.shapes[gate_shapes.PADDED]["cosine_min"] < 0.9999
    assert got.shapes["1"]["cosine_min"] == 1.0


def test_the_costly_shapes_run_a_quarter_of_their_rows() -> None:
    probe = GatedTask()
    items = gate_inputs.encode_set(probe, TEXTS)
    filler = gate_inputs.filler_for(probe, TEXTS)
    for name, plan in gate_shapes.plans(gate_inputs.BUILTIN_SEED).items():
        whole, part = gate_shapes.Tally(), gate_shapes.Tally()
        for tally, covered in ((whole, list(range(len(items)))), (part, gate_shapes.subset(len(items), name))):
            for batch in gate_shapes.on(covered, plan, items):
                tally.add([items[i] if i >= 0 else filler for i in batch])
        if name in gate_shapes.COSTLY:
            assert part.padded_tokens < whole.padded_tokens / 2, name
        else:
            assert part.padded_tokens == whole.padded_tokens, name
