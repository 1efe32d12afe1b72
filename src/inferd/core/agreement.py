"""Rank agreement between two score lists (numpy only): what the accuracy gate and the shadow report measure
for rerank. Kept apart from the gate, which needs torch, so that the fleet's CLI (shadow aggregation) starts
without importing it."""

from __future__ import annotations

import numpy as np

TOP = 3


def rank(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their average rank (as Spearman's correlation takes them)."""
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[np.argsort(values, kind="stable")] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    if (counts > 1).any():
        ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = rank(a), rank(b)
    if ra.std() == 0 or rb.std() == 0:
        return 1.0 if np.array_equal(ra, rb) else 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def top_agreement(a: np.ndarray, b: np.ndarray, k: int = TOP) -> float:
    def best(v: np.ndarray) -> set[int]:
        return set(np.argsort(-v, kind="stable")[:k].tolist())

    return len(best(a) & best(b)) / min(k, len(a))
