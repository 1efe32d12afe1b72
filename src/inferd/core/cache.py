"""A bounded LRU cache of task results (embeddings, rerank scores, class probabilities), keyed by the model's load
and a digest of the input (a text, or a query/document pair).

The seed's cautionary tale is a global list of tokenizer outputs that grew until the process died; the
only cache this service keeps has a maximum entry count, evicts the least recently used entry, and
reports its size and hit rate. Keys hold a 16-byte digest, not the text, so a long text costs no more
than a short one. The owner in the key is the model slot's ``load_id``, not its version string: a version
string is a label an operator can (by mistake) give two models, a load is one model, so the cache can
only ever answer with results of the model that would compute the answer.

Each tenant has its own entries (the ``scope``, its name): a hit answers faster, without queue and inference
times, and charges no tokens, so an entry shared across tenants would tell one tenant which exact texts another
sent. A tenant's hits are of texts it sent itself; callers without tenants share one scope.

``answer`` is the cache's part of a request (the admission step composes it): the hits answered from here, only
the rest computed, then remembered, the two merged back in the request's order.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import orjson

from inferd.core.description import ModelDescription
from inferd.core.errors import EngineError
from inferd.core.outcomes import TaskResult
from inferd.core.outputs import TextOutputs
from inferd.core.text_options import InputOptions, TextOptions

CacheKey = tuple[Hashable, str | None, bytes]
# The inputs a request's cache did not hold, with their options, computed (admission's tokenise, enqueue and wait).
Compute = Callable[[list[Any], InputOptions], Awaitable[TaskResult]]


def cache_key(item: Any, options: TextOptions) -> str:
    """What the result cache keys one input by. A text is keyed by its options too (core/text_options.py
    TextOptions.key_suffix: its prompt, cut side, truncate, max_tokens, outputs, role): the same words cut another
    way are another vector; with the default options, by the text alone. A pair is keyed by both its texts, the
    document with its options (a rerank document's cut side and truncate change its score); one slot serves one
    task, so a pair's key never meets a text's."""
    if isinstance(item, str):
        return _keyed(item, options)
    query, document = item
    return orjson.dumps([query, _keyed(document, options)]).decode()


def _keyed(text: str, options: TextOptions) -> str:
    """A text and its options as one string, never another text's with other options. The options' suffix starts
    with the key's one NUL that is not the text's, so a text holding a NUL (JSON sends one as \\u0000) is keyed
    with a lone NUL even with the default options: keyed as itself, the text "hello\\u0000" followed by a left cut's
    suffix was the key of "hello" cut from the left, and its vector answered every later "hello" cut so."""
    suffix = options.key_suffix
    if not suffix and "\x00" in text:
        suffix = "\x00"
    return text + suffix


def _key(owner: Hashable, scope: str | None, text: str) -> CacheKey:
    return owner, scope, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _nbytes(output: Any) -> int:
    """The bytes an entry's arrays hold: what the byte bound counts. A dense vector is a few KiB, but a text's
    multi-vector or token-state output is one vector per token (``[tokens, dim]``), up to the model's window: a long
    text asking for it holds hundreds of times a short one's."""
    if isinstance(output, TextOutputs):
        arrays = [output.dense, output.multivector, output.token_states]
        if output.sparse is not None:
            arrays += [output.sparse.indices, output.sparse.values]
        return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))
    return output.nbytes if isinstance(output, np.ndarray) else 0


def _owned(output: Any) -> Any:
    """A copy owning its memory: a row of the batch's output array would keep the whole batch array alive. A text's
    several outputs (core/outputs.py) stay themselves, their arrays copied (a sparse vector's are its own)."""
    if isinstance(output, TextOutputs):
        return replace(output, dense=None if output.dense is None else np.array(output.dense, copy=True),
                       multivector=None if output.multivector is None else np.array(output.multivector, copy=True))
    return np.array(output, copy=True)


class ResultCache:
    """At most ``max_entries`` entries and (``max_bytes`` > 0) at most ``max_bytes`` bytes of their arrays: a count
    alone bounds a cache of dense vectors, not one a client fills with multi-vector or token-state outputs (tens of
    KiB to megabytes a text). An entry larger than the byte bound alone is not kept."""

    def __init__(self, max_entries: int, metrics: Any = None, name: str = "embeddings", max_bytes: int = 0) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.name = name
        self.metrics = metrics
        # key -> (output, tokens, the output's bytes)
        self._entries: OrderedDict[CacheKey, tuple[Any, int, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, owner: Hashable, texts: Sequence[str], scope: str | None = None) -> dict[int, tuple[Any, int]]:
        """Cached (result, tokens) by position in ``texts``, of ``scope``'s own entries; a hit becomes the most
        recently used."""
        hits = {}
        for i, text in enumerate(texts):
            key = _key(owner, scope, text)
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                hits[i] = entry[:2]
        if self.metrics is not None:
            self.metrics.cache_hits.labels(self.name).inc(len(hits))
            self.metrics.cache_misses.labels(self.name).inc(len(texts) - len(hits))
        return hits

    def store(self, owner: Hashable, texts: Sequence[str], outputs: Sequence[Any], tokens: Sequence[int],
              scope: str | None = None) -> None:
        for text, output, count in zip(texts, outputs, tokens, strict=True):
            key = _key(owner, scope, text)
            size = _nbytes(output)
            if self.max_bytes and size > self.max_bytes:
                continue  # it would evict every other entry and still not fit
            self._drop(key)
            self._entries[key] = (_owned(output), count, size)
            self.nbytes += size
        while len(self._entries) > self.max_entries or (self.max_bytes and self.nbytes > self.max_bytes):
            self._drop(next(iter(self._entries)))
        if self.metrics is not None:
            self.metrics.cache_entries.labels(self.name).set(len(self._entries))

    def forget(self, owner: Hashable) -> int:
        """Drop every entry of an owner (a model slot that was freed), of every scope; how many there were."""
        stale = [key for key in self._entries if key[0] == owner]
        for key in stale:
            self._drop(key)
        if stale and self.metrics is not None:
            self.metrics.cache_entries.labels(self.name).set(len(self._entries))
        return len(stale)

    def _drop(self, key: CacheKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[2]

    async def answer(self, owner: Hashable, description: ModelDescription, inputs: list[Any], options: InputOptions,
                     scope: str | None, compute: Compute) -> TaskResult:
        """Answer what this cache holds for ``owner`` (a slot's load) and ``scope`` (a tenant: one tenant's hits
        never tell what another sent) of ``inputs`` encoded as ``options`` say; compute only the rest, then
        remember it."""
        each = options.per_text(len(inputs))
        keys = [cache_key(t, o) for t, o in zip(inputs, each, strict=True)]
        hits = self.lookup(owner, keys, scope)
        todo = [i for i in range(len(inputs)) if i not in hits]
        fresh = TaskResult([], [], description, {"batch_size": 0, "items": 0})
        if todo:
            try:
                fresh = await compute([inputs[i] for i in todo], options.taking(todo))
            except EngineError as exc:
                if exc.index is not None:  # an index into the inputs sent on: map it back to the request's
                    exc.index = todo[exc.index]
                raise
            self.store(owner, [keys[i] for i in todo], fresh.outputs, fresh.tokens, scope)
        outputs: list[Any] = [None] * len(inputs)
        tokens = [0] * len(inputs)
        for i, (output, count) in hits.items():
            outputs[i], tokens[i] = output, count
        for j, i in enumerate(todo):
            outputs[i], tokens[i] = fresh.outputs[j], fresh.tokens[j]
        timings = {**fresh.timings, "items": len(inputs), "cache_hits": len(hits)}
        return TaskResult(outputs, tokens, description, timings)
