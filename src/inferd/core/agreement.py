"""Rank agreement between two models' figures for the same items (numpy only): what the accuracy gate and the
shadow report measure — rank correlation and top-k agreement of scores, and the neighbour overlap of vectors
(top-k agreement of one text's similarities). Kept apart from the gate, which needs torch, so that the fleet's
CLI (shadow aggregation) starts without importing it.

Equal items are not a disagreement: the same text sent twice is computed in different batches, with other
padding, and its two figures differ by float noise (~1e-7); which of them a model ranks first is then row
order. Figures within ``TIE`` (relative to the list's scale) are ties: tied neighbours at the k-th place count
as agreeing, and items tied under both models share their rank.
"""

from __future__ import annotations

import numpy as np

TOP = 3
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
