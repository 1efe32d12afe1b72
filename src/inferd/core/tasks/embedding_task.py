"""The embedding task: answers are vectors clients store, compared by cosine and by who a text's neighbours are;
and the outputs an embedding model may give (a dense vector, a sparse vector, token vectors), each with its bounds.

- the gate: cosine min and mean to torch fp32 and top-10 neighbour overlap (core/backends/gate.py measures them);
  a sparse output by the share of each text's ten heaviest terms both agree on and the largest weight difference,
  token vectors by each text's MaxSim ranking of the other texts;
- the drift report: cosine per text between the two models' vectors (count, mean, min, percentiles, a
  histogram), and neighbourhood agreement: of each text's k nearest texts among a rolling window of recent texts,
  the share both spaces agree on (what tells a user whether their index still answers queries).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.core.agreement import (
    Bound,
    cosine_rows,
    maxsim_ranking,
    neighbour_overlap,
    overlap_at_k,
    sparse_cosine,
    term_agreement,
    unit_rows,
    weight_diff,
)
from inferd.core.errors import EngineError, Kind
from inferd.core.outputs import TextOutputs
from inferd.core.tasks.drift import Drift, Request, Stat, Worst
from inferd.core.tasks.task import Output, Task

if TYPE_CHECKING:  # the description reads the task objects (its outputs): a type only, never imported at run time
    from inferd.core.description import ModelDescription

# The cosines the report's percentiles are taken over (a candidate may shadow for days).
RECENT = 10_000
# Cosine histogram edges: most of the interesting range is between 0.99 and 1.
COSINE_EDGES = (-1.0, 0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9999, 1.0)
PERCENTILES = (1, 5, 50)


class Dense(Output):
    name = "dense"
    lead_figure = "cosine_min"

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        if kind == "int8":
            return [Bound("cosine_min", "int8_cosine_min", gate.int8_cosine_min),
                    Bound("cosine_mean", "int8_cosine_mean", gate.int8_cosine_mean),
                    Bound("overlap_at_10", "int8_overlap_at_10", gate.int8_overlap_at_10)]
        if kind == "half":
            return [Bound("cosine_min", "half_cosine_min", gate.half_cosine_min)]
        return [Bound("cosine_min", "fp32_cosine_min", gate.fp32_cosine_min)]

    def cosines(self, reference: list[Any], got: list[Any]) -> np.ndarray:
        return cosine_rows(np.stack(reference), np.stack(got))

    def figures(self, reference: list[Any], got: list[Any], ranked: bool) -> dict[str, float | None]:
        """Top-10 neighbour overlap (retrieval agreement)."""
        return {"overlap_at_10": round(overlap_at_k(np.stack(reference), np.stack(got)), 4) if ranked else None}


class Sparse(Output):
    """SPLADE's vocabulary weights, bge-m3's lexical weights."""

    name = "sparse"
    lead_figure = "sparse_top10"

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        return [Bound("sparse_top10", "sparse_top10_min", gate.sparse_top10_min),
                Bound("weight_diff_max", f"{kind}_score_diff_max", getattr(gate, f"{kind}_score_diff_max"), True)]

    def cosines(self, reference: list[Any], got: list[Any]) -> np.ndarray:
        """Over the vocabulary."""
        return np.array([sparse_cosine(x, y) for x, y in zip(reference, got, strict=True)])

    def figures(self, reference: list[Any], got: list[Any], ranked: bool) -> dict[str, float | None]:
        """The worst text's share of its ten heaviest terms both agree on, and the largest weight difference as a
        share of the text's largest weight."""
        pairs = list(zip(reference, got, strict=True))
        return {"sparse_top10": round(min(term_agreement(x, y) for x, y in pairs), 4),
                "weight_diff_max": round(max(weight_diff(x, y) for x, y in pairs), 7)}


class MultiVector(Output):
    """ColBERT's or bge-m3's token vectors."""

    name = "multivector"
    lead_figure = "maxsim_spearman"

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        return [Bound("maxsim_spearman", "maxsim_spearman_min", gate.maxsim_spearman_min),
                Bound("maxsim_top3", "maxsim_top3_min", gate.maxsim_top3_min)]

    def cosines(self, reference: list[Any], got: list[Any]) -> np.ndarray:
        """Of each kept token's vectors."""
        pairs = zip(reference, got, strict=True)
        return np.concatenate([cosine_rows(x, y) for x, y in pairs if len(x)] or [np.ones(1)])

    def figures(self, reference: list[Any], got: list[Any], ranked: bool) -> dict[str, float | None]:
        """Each text's MaxSim ranking of the other texts (Spearman and top-3, means over texts)."""
        agree = maxsim_ranking(reference, got)
        return {"maxsim_spearman": round(agree["spearman"], 6), "maxsim_top3": round(agree["top3"], 4)}


class TokenStates(Output):
    """The last hidden state of every token (TEI's /embed_all; core/tasks/token_states.py). The gate judges the
    encoder through the outputs pooled from these, so it never measures them alone: no figure of its is ever
    present, and its bounds are the dense vector's."""

    name = "token_states"
    lead_figure = "token_states_cosine_min"

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        return DENSE.bounds(kind, gate)

    def cosines(self, reference: list[Any], got: list[Any]) -> np.ndarray:
        """Of each token's state."""
        pairs = zip(reference, got, strict=True)
        return np.concatenate([cosine_rows(x, y) for x, y in pairs if len(x)] or [np.ones(1)])

    def figures(self, reference: list[Any], got: list[Any], ranked: bool) -> dict[str, float | None]:
        return {}


DENSE, SPARSE, MULTIVECTOR, TOKEN_STATES = Dense(), Sparse(), MultiVector(), TokenStates()
# What an embedding request asks for unless it says otherwise.
DEFAULT_OUTPUTS = (DENSE.name,)


class EmbeddingTask(Task):
    name = "embedding"
    stored_vectors = True
    gate_vectors = True

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        return DENSE.bounds(kind, gate)

    def drift(self, worst: Worst, labels: Sequence[str] | None, multi_label: bool, window: int,
              neighbours: int) -> Drift:
        return EmbeddingDrift(worst, window, neighbours)

    def facts(self, dimension: int | None) -> dict[str, Any]:
        return {} if dimension is None else {"dimension": int(dimension)}

    def outputs(self, facts: Mapping[str, Any]) -> list[str] | None:
        return list(facts.get("outputs") or DEFAULT_OUTPUTS)

    def refusal(self, description: ModelDescription, dimensions: int | None,
                outputs: tuple[str, ...]) -> EngineError | None:
        # A dense vector too: every embedding route asks for one, which a SPLADE or ColBERT model does not give.
        return super().refusal(description, dimensions, outputs) or missing_outputs(description, outputs)


EMBEDDING = EmbeddingTask()


def missing_outputs(description: ModelDescription, outputs: tuple[str, ...]) -> EngineError | None:
    """Outputs the model load cannot give (its description's ``outputs``), refused before any work."""
    gives = tuple(description.outputs or DEFAULT_OUTPUTS)
    missing = [k for k in outputs if k not in gives]
    if not missing:
        return None
    return EngineError(Kind.INVALID_INPUT, f"{', '.join(missing)} is not an output of model {description.name!r}, "
                       f"which gives {', '.join(gives)}", "unsupported_output", field="outputs")


def dense_of(output: Any) -> Any:
    """An embedding answer's dense vector (None: it holds none)."""
    return output.dense if isinstance(output, TextOutputs) else output


class EmbeddingDrift(Drift):
    def __init__(self, worst: Worst, window: int, neighbours: int) -> None:
        super().__init__(worst)
        self.window, self.neighbours = window, neighbours
        self.cosine, self.overlap = Stat(), Stat()
        self.histogram = [0] * (len(COSINE_EDGES) - 1)
        self.recent: deque[float] = deque(maxlen=RECENT)
        self._win_a: deque[np.ndarray] = deque(maxlen=window)
        self._win_b: deque[np.ndarray] = deque(maxlen=window)

    def usable(self, active: Sequence[Any], shadow: Sequence[Any]) -> tuple[list[Any], list[Any]] | None:
        """Compared by the dense vector; an answer without one (sparse or multi-vector alone, asked or all the
        candidate gives) is not read as a vector."""
        a, b = [dense_of(x) for x in active], [dense_of(x) for x in shadow]
        return None if any(x is None for x in (*a, *b)) else (a, b)

    def add(self, a: np.ndarray, b: np.ndarray, request: Request) -> dict[str, Any]:
        cos = cosine_rows(a, b)
        self.cosine.add(cos)
        self.recent.extend(cos.tolist())
        hist, _ = np.histogram(np.clip(cos, -1.0, 1.0), bins=COSINE_EDGES)
        self.histogram = [h + int(n) for h, n in zip(self.histogram, hist, strict=True)]
        ua, ub = unit_rows(a), unit_rows(b)
        overlaps = []
        for i in range(len(a)):
            overlap = None
            if len(self._win_a) >= self.neighbours:
                overlap = neighbour_overlap(np.asarray(self._win_a), np.asarray(self._win_b), ua[i], ub[i],
                                            self.neighbours)
                overlaps.append(overlap)
            self._win_a.append(ua[i])
            self._win_b.append(ub[i])
            extra = {} if overlap is None else {"overlap": overlap}
            self.worst.note(1.0 - float(cos[i]), request.request_id, i, request.tokens, request.inputs,
                            cosine=cos[i], **extra)
        self.overlap.add(overlaps)
        return {"cosine": cos.tolist(), "overlap": overlaps}

    def _percentile(self, p: int) -> float | None:
        return round(float(np.percentile(np.asarray(self.recent), p)), 7) if self.recent else None

    def figures(self) -> dict[str, float | None]:
        return {"cosine_mean": self.cosine.as_dict()["mean"], "cosine_min": self.cosine.as_dict()["min"],
                "cosine_p1": self._percentile(1), "overlap_mean": self.overlap.as_dict()["mean"]}

    def sections(self) -> dict[str, Any]:
        return {"cosine": {**self.cosine.as_dict(),
                           "percentiles": {f"p{p}": self._percentile(p) for p in PERCENTILES},
                           "histogram": {"edges": list(COSINE_EDGES), "counts": list(self.histogram)}},
                "neighbours": {"k": self.neighbours, "window": self.window, **self.overlap.as_dict()}}
