"""What one text's embedding result may carry beyond one dense vector: a sparse vector (SPLADE's vocabulary weights,
bge-m3's lexical weights) and a multi-vector (ColBERT's or bge-m3's token vectors), any of them from one forward
pass (core/tasks/sparse.py, core/tasks/multivector.py).

A handler of a model with more than a dense head answers each text with ``TextOutputs``, holding exactly the kinds
the text asked for; a dense-only model answers a bare vector (``np.ndarray``) as it always has. A text asks by its
options' ``outputs`` (core/text_options.py TextOptions: a tuple of ``OUTPUTS`` names; ``asked`` reads it), none: the
model's default outputs. No torch (numpy only), so the HTTP layer can read these without importing it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from inferd.core.text_options import TextOptions

OUTPUTS = ("dense", "sparse", "multivector", "token_states")


@dataclass(frozen=True, eq=False)
class SparseVector:
    """Nonzero weights by vocabulary id: ``indices`` ascending and unique (int64), ``values`` (float32, > 0) in the
    same order, and (``tokens``) each id's token text, for clients that index words rather than ids."""

    indices: np.ndarray
    values: np.ndarray
    tokens: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def pruned(self, top_k: int | None = None, threshold: float | None = None) -> SparseVector:
        """The weights above ``threshold`` (strictly), at most ``top_k`` of them (the largest; ties by lower id),
        still in id order."""
        keep = np.ones(len(self.values), dtype=bool)
        if threshold is not None:
            keep &= self.values > threshold
        if top_k is not None and int(keep.sum()) > top_k:
            candidates = np.flatnonzero(keep)
            order = np.lexsort((self.indices[candidates], -self.values[candidates]))
            keep = np.zeros(len(self.values), dtype=bool)
            keep[candidates[order[:top_k]]] = True
        tokens = None if self.tokens is None else tuple(t for t, k in zip(self.tokens, keep, strict=True) if k)
        return SparseVector(self.indices[keep], self.values[keep], tokens)

    def dense(self, size: int) -> np.ndarray:
        """As a vector over the whole vocabulary (``size`` ids): for comparisons, never for the wire."""
        out = np.zeros(size, dtype=np.float32)
        out[self.indices] = self.values
        return out


def sparse_from_weights(ids: Iterable[int], weights: Iterable[float]) -> SparseVector:
    """The largest weight of each id among (id, weight) pairs, zeros and below dropped: a token seen several times
    in a text counts once, at its largest weight (bge-m3's lexical weights, SPLADE's max pooling)."""
    ids_a = np.asarray(list(ids), dtype=np.int64)
    w = np.asarray(list(weights), dtype=np.float32)
    if len(ids_a) == 0:
        return SparseVector(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
    unique, inverse = np.unique(ids_a, return_inverse=True)
    best = np.zeros(len(unique), dtype=np.float32)
    np.maximum.at(best, inverse, w)
    keep = best > 0
    return SparseVector(unique[keep], best[keep])


@dataclass(frozen=True, eq=False)
class TextOutputs:
    """One text's outputs, those it asked for: ``dense`` (a vector), ``sparse``, ``multivector`` (one
    normalised vector per kept token, ``[tokens, dim]`` float32)."""

    dense: np.ndarray | None = None
    sparse: SparseVector | None = None
    multivector: np.ndarray | None = None
    # The last hidden state of every token the model saw, ``[tokens, hidden]`` float32 (core/tasks/token_states.py).
    token_states: np.ndarray | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in OUTPUTS if getattr(self, k) is not None)


def token_vectors_refusal(count: int, limit: int) -> str:
    """Why a request's token vectors are refused: a multi-vector answer is tokens x dimension floats per text."""
    return (f"the multi-vector output of this request holds {count} token vectors; at most {limit} per response "
            "(limits.max_multivector_tokens): send fewer or shorter texts")


def asked(options: TextOptions, default: tuple[str, ...]) -> tuple[str, ...]:
    """The outputs a text's options ask for, else ``default``; always in OUTPUTS' order."""
    wanted = options.outputs or default
    return tuple(k for k in OUTPUTS if k in wanted)


def is_query(options: TextOptions) -> bool:
    """Whether a text's options make it a query (``role`` "query"), which a late-interaction model encodes with its
    query marker and expansion; anything else is a document."""
    return options.role == "query"


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Late interaction (ColBERT): for each query token vector its best dot product over the document's token
    vectors, summed. Vectors are normalised by the model, so each term is a cosine."""
    if len(query) == 0 or len(document) == 0:
        return 0.0
    sims = np.asarray(query, dtype=np.float32) @ np.asarray(document, dtype=np.float32).T
    return float(sims.max(axis=1).sum())


def maxsim_scores(query: np.ndarray, documents: list[np.ndarray]) -> np.ndarray:
    """MaxSim of one query against each document, in order (a late-interaction model served as a reranker)."""
    return np.asarray([maxsim(query, d) for d in documents], dtype=np.float32)
