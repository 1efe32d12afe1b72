"""The batch shapes the accuracy gate runs its inputs in, and a runner's outputs over them.

A converted graph can be right alone and wrong in a batch (a mask that leaks padding, a scale computed over the
batch), so every input is run at several shapes: alone, in sorted batches of 32, in shuffled batches of 32 (mixed
lengths), and seven at a time padded to a long document (``PADDED``: the filler, core/backends/gate_inputs.py).
Every batch is padded to its own longest input, never to the model's maximum.

The costly shapes (``COSTLY``: a mixed batch of 32 holds a long document about every other batch, and a padded one
always, so every row runs at the long length) run on every ``SUBSET_STEP``-th input, every long document among
them (``AT_LIMIT_SHARE`` is a multiple of it). What they add to the cheap shapes is what padding beside a longer
input does to a text, which any text shows, and a wrong mask shows on every one; the cheap shapes judge every input
at its own length. Their rows being the long ones, the costly shapes hold most of a candidate's padded tokens:
``Tally`` counts what the gate ran (/info's ``gate.figures.ran``), and tests/unit/test_gate_subset.py holds a
costly shape's subset under half the padded tokens of the whole set.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from inferd.core.backends.base import Runner
from inferd.core.backends.gate_inputs import GatedTask
from inferd.core.preprocess import Encoded

Plan = Callable[[list[Encoded]], list[list[int]]]
PADDED = "padded to a long text"
COSTLY = ("32 mixed", PADDED)
SUBSET_STEP = 4


@dataclass
class Tally:
    """What the gate ran: batches, padded tokens (rows x the batch's longest input) and the longest batch."""

    batches: int = 0
    padded_tokens: int = 0
    longest: int = 0

    def add(self, batch: list[Encoded]) -> None:
        longest = max(e.tokens for e in batch)
        self.batches += 1
        self.padded_tokens += longest * len(batch)
        self.longest = max(self.longest, longest)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def plans(seed: int) -> dict[str, Plan]:
    """Batch plans: name -> function of the items giving lists of indices (a padding row is -1)."""

    def alone(items: list[Encoded]) -> list[list[int]]:
        return [[i] for i in range(len(items))]

    def sorted32(items: list[Encoded]) -> list[list[int]]:
        order = sorted(range(len(items)), key=lambda i: items[i].tokens)
        return [order[k:k + 32] for k in range(0, len(order), 32)]

    def mixed32(items: list[Encoded]) -> list[list[int]]:
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        return [order[k:k + 32] for k in range(0, len(order), 32)]

    def padded(items: list[Encoded]) -> list[list[int]]:
        # Seven texts and one long document: every row of the batch is padded to the long one.
        return [[*range(k, min(k + 7, len(items))), -1] for k in range(0, len(items), 7)]

    return {"1": alone, "32 sorted": sorted32, "32 mixed": mixed32, PADDED: padded}


def subset(count: int, name: str) -> list[int]:
    """The inputs a batch shape runs on: all of them, or for a costly shape every SUBSET_STEP-th (see COSTLY)."""
    return list(range(SUBSET_STEP - 1, count, SUBSET_STEP)) if name in COSTLY else list(range(count))


def on(covered: list[int], plan: Plan, items: list[Encoded]) -> list[list[int]]:
    """A batch plan made over ``covered`` inputs only, in the full set's indices (padding rows stay -1)."""
    return [[covered[j] if j >= 0 else -1 for j in batch] for batch in plan([items[i] for i in covered])]


def outputs(probe: GatedTask, runner: Runner, items: list[Encoded], plan: list[list[int]],
            filler: Encoded, tally: Tally | None = None, covered: list[int] | None = None) -> np.ndarray:
    """The rows of the inputs ``covered`` (all, by default), in that order, computed in the plan's batches."""
    rows: list[np.ndarray | None] = [None] * len(items)
    for batch in plan:
        inputs = [items[i] if i >= 0 else filler for i in batch]
        if tally is not None:
            tally.add(inputs)
        out = probe.forward(runner, inputs)
        for i, row in zip(batch, out, strict=True):
            if i >= 0:
                rows[i] = row
    return np.stack([rows[i] for i in (range(len(items)) if covered is None else covered)]  # type: ignore[misc]
                    ).astype(np.float64)


def outputs_of(probe: GatedTask, runner: Runner, items: list[Encoded], plan: list[list[int]], filler: Encoded,
               tally: Tally) -> dict[str, list[Any]]:
    """Each output's value per input (``forward_outputs``), over a batch plan."""
    rows: dict[str, list[Any]] = {}
    for batch in plan:
        inputs = [items[i] if i >= 0 else filler for i in batch]
        tally.add(inputs)
        for kind, values in probe.forward_outputs(runner, inputs).items():
            got = rows.setdefault(kind, [None] * len(items))
            for i, value in zip(batch, values, strict=True):
                if i >= 0:
                    got[i] = value
    return rows
