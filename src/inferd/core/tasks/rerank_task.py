"""The rerank task: a score per (query, document) pair, judged by how each query's documents rank.

- the gate: each query's 16 documents (one of which it was cut from) ranked as torch fp32 ranks them (Spearman mean
  over queries, top-3 agreement), and the largest score difference as a share of torch's range over the set (a
  logit's scale is the model's);
- the drift report: per request (one query and its documents) the Spearman correlation of the two models' scores,
  top-3 agreement, and the score deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd.core.agreement import Bound, ranking
from inferd.core.tasks.drift import Drift, Request, Stat, Worst
from inferd.core.tasks.task import Task

PER_QUERY = 16  # documents per query in the gate's set


class RerankTask(Task):
    name = "rerank"
    gate_query = "what is this about"
    unit = "pairs"
    takes_pairs = True

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        return [Bound("spearman_mean", "rerank_spearman_min", gate.rerank_spearman_min),
                Bound("top3_agreement", "rerank_top3_min", gate.rerank_top3_min),
                Bound("score_diff_max", f"{kind}_score_diff_max", getattr(gate, f"{kind}_score_diff_max"), True)]

    def drift(self, worst: Worst, labels: Sequence[str] | None, multi_label: bool, window: int,
              neighbours: int) -> Drift:
        return RankingDrift(worst)

    def gate_inputs(self, texts: Sequence[str]) -> list[Any]:
        """Query/document pairs: each group of PER_QUERY texts is one query's documents, the query the start of one
        of them, so a query has one relevant document and a ranking to keep."""
        pairs: list[tuple[str, str]] = []
        for g in range(len(texts) // PER_QUERY):
            docs = texts[g * PER_QUERY:(g + 1) * PER_QUERY]
            source = docs[g % PER_QUERY]
            query = " ".join(source.split()[:8]) if " " in source else source[:16]
            pairs += [(query, d) for d in docs]
        return pairs

    def gate_scores(self, out: np.ndarray) -> np.ndarray:
        return out[:, 0]

    def gate_span(self, reference: np.ndarray) -> float:
        return float(reference.max() - reference.min()) or 1.0

    def gate_figures(self, reference: np.ndarray, got: np.ndarray, multi_label: bool) -> dict[str, float]:
        """Per query (each PER_QUERY consecutive pairs), rank agreement with the reference; score difference as a
        share of the reference's range over the whole set."""
        groups = [slice(k, k + PER_QUERY) for k in range(0, len(reference) - PER_QUERY + 1, PER_QUERY)]
        per_query = [ranking(reference[g], got[g]) for g in groups]
        return {"spearman_mean": round(float(np.mean([q["spearman"] for q in per_query])), 6),
                "top3_agreement": round(float(np.mean([q["top3"] for q in per_query])), 4),
                "score_diff_max": round(float(np.abs(reference - got).max()) / self.gate_span(reference), 7)}


RERANK = RerankTask()


class RankingDrift(Drift):
    def __init__(self, worst: Worst) -> None:
        super().__init__(worst)
        self.spearman, self.top3, self.delta = Stat(), Stat(), Stat()

    def add(self, a: np.ndarray, b: np.ndarray, request: Request) -> dict[str, Any]:
        a, b = a[:, 0], b[:, 0]  # [score, raw] rows
        deltas = np.abs(a - b)
        self.delta.add(deltas)
        out: dict[str, Any] = {"score_delta_max": float(deltas.max()) if len(deltas) else 0.0}
        if len(a) >= 2:
            figures = ranking(a, b)
            self.spearman.add([figures["spearman"]])
            self.top3.add([figures["top3"]])
            out.update(figures)
        worst = int(deltas.argmax()) if len(deltas) else 0
        self.worst.note(float(deltas.max()) if len(deltas) else 0.0, request.request_id, worst, request.tokens,
                        request.inputs, spearman=out.get("spearman", 1.0), score_delta=out["score_delta_max"])
        return out

    def figures(self) -> dict[str, float | None]:
        return {"spearman_mean": self.spearman.as_dict()["mean"], "top3_agreement": self.top3.as_dict()["mean"],
                "score_delta_max": self.delta.as_dict()["max"]}

    def sections(self) -> dict[str, Any]:
        return {"spearman": self.spearman.as_dict(), "top3_agreement": self.top3.as_dict(),
                "score_delta": self.delta.as_dict()}
