"""How far two models' outputs for the same inputs agree, and whether that is within the configured bounds
(numpy only): what the accuracy gate (core/backends/gate.py: a converted model against torch fp32) and the
shadow report (core/shadow.py: a candidate against the active model on live traffic) both measure and judge,
written once so that the two hold a model to the same figures under the same ``model.gate`` settings.

- vectors: the cosine of each input's two vectors, and neighbour overlap (top-k agreement of one text's
  similarities to other texts);
- rankings: rank correlation and top-k agreement of one query's scores;
- labels: the share of an input's label decisions both models make alike;
- sparse vectors (SPLADE, lexical weights): the share of a text's ten heaviest terms both models agree on, and the
  largest weight difference as a share of the text's largest weight;
- token vectors (multi-vector): the MaxSim ranking of the other texts by each text, as rank agreement.

Which of them a task is judged by is the task's own (core/tasks/: ``*_task.py``). Kept apart from the gate, which
needs torch, so that the fleet's CLI (shadow aggregation) starts without it.

Equal items are not a disagreement: the same text sent twice is computed in different batches, with other
padding, and its two figures differ by float noise (~1e-7); which of them a model ranks first is then row
order. Figures within ``TIE`` (relative to the list's scale) are ties: tied neighbours at the k-th place count
as agreeing, and items tied under both models share their rank.

A bound is judged so that it can always fail: a NaN figure passes no bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

TOP = 3
# Neighbours compared per text (the gate's overlap@10; shadow.neighbours sets the shadow report's own).
NEIGHBOURS = 10
# Far above float32 noise on a cosine or a logit of order 1, far below any difference a user's ranking acts on.
TIE = 1e-5


def tolerance(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    return TIE * max(1.0, float(finite.max()) if len(finite) else 1.0)


def tie_groups(values: np.ndarray) -> np.ndarray:
    """A group id per value: neighbours in sorted order closer than the tolerance share a group."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    ids = np.empty(len(values), dtype=np.int64)
    ids[order] = np.concatenate([[0], np.cumsum(np.diff(values[order]) > tolerance(values))])
    return ids


def rank(values: np.ndarray, ties: np.ndarray | None = None) -> np.ndarray:
    """Ranks 1..n, each group of ``ties`` (default: equal values) given its average rank, as Spearman's
    correlation takes ties."""
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[np.argsort(values, kind="stable")] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values if ties is None else ties, return_inverse=True, return_counts=True)
    if (counts > 1).any():
        ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    # Tied only where both models tie: one model's near-equal scores that the other tells apart stay ranked.
    ties = np.unique(np.stack([tie_groups(a), tie_groups(b)], axis=1), axis=0, return_inverse=True)[1].ravel()
    ra, rb = rank(a, ties), rank(b, ties)
    if ra.std() == 0 or rb.std() == 0:
        return 1.0 if np.array_equal(ra, rb) else 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def _top_within(a: np.ndarray, b: np.ndarray, k: int) -> int:
    """How many of ``a``'s k best are among ``b``'s k best, one tied with ``b``'s k-th counting as among them."""
    best = np.argsort(-a, kind="stable")[:k]
    kth = np.sort(b)[::-1][k - 1]
    return int(np.count_nonzero(b[best] >= kth - tolerance(b)))


def top_agreement(a: np.ndarray, b: np.ndarray, k: int = TOP) -> float:
    """The share of one model's k best items the other also ranks in its k best, ties counting as agreeing;
    the lower of the two directions, so that a model scoring everything alike does not agree with every one."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    k = min(k, len(a))
    return min(_top_within(a, b, k), _top_within(b, a, k)) / k


# -- vectors --------------------------------------------------------------------------------------------------


def unit_rows(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.clip(np.linalg.norm(v, axis=1, keepdims=True), 1e-12, None)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each row of ``a`` with the same row of ``b``; two spaces of different sizes share none (0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return np.zeros(len(a))
    return (unit_rows(a) * unit_rows(b)).sum(axis=1)


def neighbour_overlap(others_a: np.ndarray, others_b: np.ndarray, a: np.ndarray, b: np.ndarray,
                      k: int = NEIGHBOURS) -> float:
    """Of one text's k nearest among other texts, the share both models agree on: ``a`` and ``b`` are the text's
    unit vectors under each model, ``others_a`` and ``others_b`` the other texts' (the same texts, row by row).
    A text repeated among the others ties with its copies, and which copy fills the k-th place is no
    disagreement."""
    return top_agreement(others_a @ a, others_b @ b, k)


def overlap_at_k(a: np.ndarray, b: np.ndarray, k: int = NEIGHBOURS) -> float:
    """The mean neighbour overlap of every text among all the others (itself excluded)."""
    ua, ub = unit_rows(a), unit_rows(b)
    sa, sb = ua @ ua.T, ub @ ub.T
    return float(np.mean([top_agreement(np.delete(x, i), np.delete(y, i), k)
                          for i, (x, y) in enumerate(zip(sa, sb, strict=True))]))


# -- rankings and labels --------------------------------------------------------------------------------------


def ranking(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """One query's documents as two models score them: Spearman's correlation and top-3 agreement."""
    return {"spearman": spearman(a, b), "top3": top_agreement(a, b)}


def labels_of(probs: np.ndarray, multi_label: bool) -> np.ndarray:
    """A classifier's decisions: its label (argmax), or for a multi-label model each label at 0.5."""
    probs = np.asarray(probs, dtype=np.float64)
    return (probs >= 0.5) if multi_label else probs.argmax(axis=1)


def label_agreement(a: np.ndarray, b: np.ndarray, multi_label: bool) -> np.ndarray:
    """Per input, the share of its label decisions both models make alike (1 or 0 for one label per input)."""
    la, lb = labels_of(a, multi_label), labels_of(b, multi_label)
    return (la == lb).mean(axis=1) if multi_label else (la == lb).astype(np.float64)


# -- sparse and token vectors ---------------------------------------------------------------------------------

TERMS = 10  # the heaviest terms of a sparse vector whose agreement is judged


def _aligned(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Two sparse vectors, each (ids, weights), as weights over the union of their ids."""
    ids = np.union1d(a[0], b[0])
    wa, wb = np.zeros(len(ids)), np.zeros(len(ids))
    wa[np.searchsorted(ids, a[0])] = a[1]
    wb[np.searchsorted(ids, b[0])] = b[1]
    return wa, wb


def term_agreement(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], k: int = TERMS) -> float:
    """Of one text's k heaviest terms, the share both models agree on (top_agreement: ties agree); k is at most
    the terms either has, and a text neither gives a term agrees."""
    wa, wb = _aligned(a, b)
    n = min(k, int(max(np.count_nonzero(wa), np.count_nonzero(wb))))
    return 1.0 if n == 0 else top_agreement(wa, wb, n)


def weight_diff(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """The largest weight difference of one text's sparse vectors, a share of its largest weight under ``a``."""
    wa, wb = _aligned(a, b)
    if len(wa) == 0:
        return 0.0
    return float(np.abs(wa - wb).max() / max(float(np.abs(wa).max()), 1e-12))


def sparse_cosine(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    wa, wb = _aligned(a, b)
    na, nb = float(np.linalg.norm(wa)), float(np.linalg.norm(wb))
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(wa @ wb / (na * nb))


def maxsim_matrix(vectors: list[np.ndarray]) -> np.ndarray:
    """MaxSim of every text (row, as the query) against every text (column, as the document)."""
    out = np.zeros((len(vectors), len(vectors)))
    for i, q in enumerate(vectors):
        for j, d in enumerate(vectors):
            if len(q) and len(d):
                out[i, j] = float((np.asarray(q, np.float64) @ np.asarray(d, np.float64).T).max(axis=1).sum())
    return out


def maxsim_ranking(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, float]:
    """Each text's MaxSim ranking of the other texts under two models (token vectors per text): Spearman's
    correlation and top-3 agreement, each the mean over texts."""
    sa, sb = maxsim_matrix(a), maxsim_matrix(b)
    rows = [ranking(np.delete(x, i), np.delete(y, i)) for i, (x, y) in enumerate(zip(sa, sb, strict=True))]
    return {"spearman": float(np.mean([r["spearman"] for r in rows])),
            "top3": float(np.mean([r["top3"] for r in rows]))}


# -- bounds ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """A figure's bound: at least ``bound`` (at most, when ``upper``), set by ``model.gate.<setting>``. Which
    bounds a model is held to is its task's (core/tasks/: ``Task.bounds``, ``Output.bounds``)."""

    figure: str
    setting: str
    bound: float
    upper: bool = False

    def passes(self, value: float) -> bool:
        # Written so that NaN fails: every comparison with NaN is false.
        return bool(value <= self.bound) if self.upper else bool(value >= self.bound)

    def failure(self, value: float, name: str | None = None) -> str:
        """The figure past its bound, worded for an operator (``name``: the figure as the caller shows it)."""
        return (f"{name or self.figure} {value:.6f} {'>' if self.upper else '<'} {self.bound} "
                f"(model.gate.{self.setting})")


def judge(figures: Mapping[str, float | None], held_to: list[Bound],
          names: Mapping[str, str] | None = None) -> tuple[list[str], list[Bound]]:
    """Every figure past its bound, worded (``names``: how the caller shows each figure), and the bounds whose
    figure is not there (None: not measured, or not one this model has)."""
    failures, missing = [], []
    for b in held_to:
        value = figures.get(b.figure)
        if value is None:
            missing.append(b)
        elif not b.passes(value):
            failures.append(b.failure(value, (names or {}).get(b.figure)))
    return failures, missing
