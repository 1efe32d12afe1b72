"""A bounded LRU cache of embeddings, keyed by model version and a digest of the text.

The seed's cautionary tale is a global list of tokenizer outputs that grew until the process died; the
only cache this service keeps has a maximum entry count, evicts the least recently used entry, and
reports its size and hit rate. Keys hold a 16-byte digest, not the text, so a long text costs no more
than a short one; the version in the key means a reload never serves the old model's vectors.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

CacheKey = tuple[str, bytes]


def _key(version: str, text: str) -> CacheKey:
    return version, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class EmbeddingCache:
    def __init__(self, max_entries: int, metrics: Any = None, name: str = "embeddings") -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self.name = name
        self.metrics = metrics
        self._entries: OrderedDict[CacheKey, tuple[np.ndarray, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, version: str, texts: Sequence[str]) -> dict[int, tuple[np.ndarray, int]]:
        """Cached (vector, tokens) by position in ``texts``; a hit becomes the most recently used."""
        hits = {}
        for i, text in enumerate(texts):
            key = _key(version, text)
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                hits[i] = entry
        if self.metrics is not None:
            self.metrics.cache_hits.labels(self.name).inc(len(hits))
            self.metrics.cache_misses.labels(self.name).inc(len(texts) - len(hits))
        return hits

    def store(self, version: str, texts: Sequence[str], vectors: Sequence[Any], tokens: Sequence[int]) -> None:
        for text, vector, count in zip(texts, vectors, tokens, strict=True):
            # A copy: a row of the batch's output array would keep the whole batch array alive.
            self._entries[_key(version, text)] = (np.array(vector, copy=True), count)
            self._entries.move_to_end(_key(version, text))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        if self.metrics is not None:
            self.metrics.cache_entries.labels(self.name).set(len(self._entries))
