"""How the pieces of one document (core/pieces.py) are merged back into the document's one answer, per output:
the dense vector is the mean of the pieces' weighted by their tokens, renormalised when the model's vectors are
unit length (as a client averaging its chunks' vectors would, but with each piece's weight its share of the
text); sparse weights are merged by max per vocabulary id (a term weighs in the document what it weighs in the
piece where it matters most: SPLADE's and bge-m3's own max over tokens, extended over pieces); token vectors are
the pieces' concatenated (late interaction scores a document by its best-matching tokens, wherever they are).

Keyed by the Output objects (core/tasks/embedding_task.py), so no caller branches on an output's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from inferd.core.outputs import SparseVector, TextOutputs, sparse_from_weights
from inferd.core.tasks.embedding_task import DENSE, MULTIVECTOR, SPARSE
from inferd.core.tasks.kinds import OUTPUTS
from inferd.core.tasks.task import Output


def pooled_dense(values: Sequence[np.ndarray], weights: Sequence[int], unit: bool) -> np.ndarray:
    """The token-weighted mean of the pieces' vectors (renormalised when ``unit``)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:  # pieces of no countable token (a run of unknown symbols): each counts alike
        w = np.ones_like(w)
    mean = (np.asarray(np.stack(values), dtype=np.float64) * w[:, None]).sum(axis=0) / w.sum()
    if unit:
        norm = np.linalg.norm(mean)
        mean = mean / norm if norm > 0 else mean
    return mean.astype(np.float32)


def max_sparse(values: Sequence[SparseVector], weights: Sequence[int], unit: bool) -> SparseVector:
    """Each id at its largest weight over the pieces; token texts kept where the pieces carry them."""
    merged = sparse_from_weights(np.concatenate([v.indices for v in values]),
                                 np.concatenate([v.values for v in values]))
    if all(v.tokens is None for v in values):
        return merged
    text = {int(i): t for v in values if v.tokens is not None for i, t in zip(v.indices, v.tokens, strict=True)}
    return SparseVector(merged.indices, merged.values, tuple(text.get(int(i), "") for i in merged.indices))


def joined_tokens(values: Sequence[np.ndarray], weights: Sequence[int], unit: bool) -> np.ndarray:
    """The pieces' token vectors, in the document's order."""
    return np.concatenate([np.asarray(v, dtype=np.float32) for v in values], axis=0)


MERGES: dict[Output, Callable[[Sequence[Any], Sequence[int], bool], Any]] = {
    DENSE: pooled_dense, SPARSE: max_sparse, MULTIVECTOR: joined_tokens}


def mergeable(outputs: Sequence[str]) -> bool:
    """Whether every output asked (by name) merges from pieces (a text's token states, /embed_all's, do not: they
    are the text's own tokens)."""
    return all(OUTPUTS.get(name) in MERGES for name in outputs)


def merge(outputs: Sequence[Any], weights: Sequence[int], unit: bool) -> Any:
    """One document's answer from its pieces' (in order) and their token counts: a bare dense vector when the
    pieces are bare vectors (a dense-only model), else the outputs the pieces hold, each merged its own way."""
    if not isinstance(outputs[0], TextOutputs):
        return pooled_dense(outputs, weights, unit)
    merged = {output.name: how([getattr(o, output.name) for o in outputs], weights, unit)
              for output, how in MERGES.items() if getattr(outputs[0], output.name) is not None}
    return TextOutputs(**merged)
