"""The accuracy gate's figures, as measured and as a cache entry stores them (``meta.json``'s ``gate.figures``).

Two records: ``GateFigures`` for what is judged as vectors (an embedding model, each of its outputs) and
``ScoreFigures`` for what is judged as scores (rerank, classification), which names its task. Each figure is the
worst over the batch shapes (core/backends/gate_shapes.py); ``shapes`` keeps every shape's own. What the figures
say (pass or refuse, and why) is core/backends/gate_verdict.py's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


def known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The stored figures the class holds: an entry written by another build of the same format may hold more."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class GateFigures:
    cosine_min: float
    cosine_mean: float
    overlap_at_10: float | None
    invariance_min: float
    texts: int
    shapes: dict[str, dict[str, float | None]]
    # Outputs that were not finite, over every batch shape (a failure whatever the thresholds).
    nonfinite: int = 0
    # What the gate ran, reference and candidate together (Tally.as_dict: batches, padded tokens, the longest
    # batch's length): counts, not figures, so apart from them.
    ran: dict[str, int] = field(default_factory=dict)
    # Sparse and token-vector outputs' figures (None: the model has no such output).
    sparse_top10: float | None = None
    weight_diff_max: float | None = None
    maxsim_spearman: float | None = None
    maxsim_top3: float | None = None

    task = "embedding"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateFigures:
        return cls(**known(cls, data))


@dataclass(frozen=True)
class ScoreFigures:
    """Rerank and classification figures (core/backends/gate.py's docstring); a figure the task has not is None."""

    task: str
    spearman_mean: float | None
    top3_agreement: float | None
    label_agreement: float | None
    score_diff_max: float
    invariance_diff_max: float
    texts: int
    shapes: dict[str, dict[str, float | None]]
    nonfinite: int = 0
    ran: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScoreFigures:
        return cls(**known(cls, data))


Figures = GateFigures | ScoreFigures


def figures_from_dict(data: dict[str, Any]) -> Figures:
    return ScoreFigures.from_dict(data) if "task" in data else GateFigures.from_dict(data)
