"""The bounded embedding cache: LRU order, the bound, version separation, and the engine using it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from enginekit import EngineKit
from fakes import HashHandler, vector_for
from settingskit import make_settings

from inferd.core.cache import ResultCache, cache_key
from inferd.core.errors import EngineError, Kind
from inferd.core.outputs import TextOutputs
from inferd.core.text_options import PLAIN, TextOptions
from inferd.utils.metrics import Metrics


def vec(x: float) -> np.ndarray:
    return np.full(4, x, dtype=np.float32)


def test_lookup_returns_hits_by_position_with_their_token_counts() -> None:
    cache = ResultCache(10)
    cache.store("1", ["a", "b"], [vec(1), vec(2)], [3, 4])
    hits = cache.lookup("1", ["b", "x", "a"])
    assert sorted(hits) == [0, 2]
    assert hits[0][0][0] == 2 and hits[0][1] == 4
    assert hits[2][0][0] == 1 and hits[2][1] == 3


def test_the_bound_evicts_the_least_recently_used() -> None:
    cache = ResultCache(2)
    cache.store("1", ["a", "b"], [vec(1), vec(2)], [1, 1])
    cache.lookup("1", ["a"])  # a is now more recent than b
    cache.store("1", ["c"], [vec(3)], [1])
    assert len(cache) == 2
    assert sorted(cache.lookup("1", ["a", "b", "c"])) == [0, 2]


def test_versions_never_share_entries() -> None:
    cache = ResultCache(10)
    cache.store("1", ["a"], [vec(1)], [1])
    assert cache.lookup("2", ["a"]) == {}


def test_tenants_never_share_entries_and_a_freed_load_forgets_every_tenant_s() -> None:
    """A hit is faster and uncharged: one tenant's entry answering another would tell it what the first sent."""
    cache = ResultCache(10)
    cache.store("1", ["a"], [vec(1)], [1], "alpha")
    assert cache.lookup("1", ["a"], "beta") == {} and cache.lookup("1", ["a"]) == {}
    assert list(cache.lookup("1", ["a"], "alpha")) == [0]
    cache.store("1", ["a"], [vec(1)], [1], "beta")
    cache.store("2", ["a"], [vec(1)], [1], "beta")
    assert cache.forget("1") == 2 and len(cache) == 1


def test_the_byte_bound_evicts_the_least_recently_used_and_keeps_no_entry_larger_than_itself() -> None:
    """A multi-vector or token-state answer is a vector per token: entries alone do not bound the bytes held."""
    tokens = np.ones((100, 8), dtype=np.float32)  # 3,200 bytes, a long text's token states
    cache = ResultCache(1000, max_bytes=7000)
    cache.store("1", ["a", "b"], [TextOutputs(token_states=tokens), TextOutputs(token_states=tokens)], [100, 100])
    cache.lookup("1", ["a"])  # a is now more recent than b
    cache.store("1", ["c"], [TextOutputs(multivector=tokens)], [100])
    assert sorted(cache.lookup("1", ["a", "b", "c"])) == [0, 2] and cache.nbytes == 6400
    cache.store("1", ["huge"], [TextOutputs(token_states=np.ones((1000, 8), dtype=np.float32))], [1000])
    assert cache.lookup("1", ["huge"]) == {} and len(cache) == 2  # not kept, and evicted nothing
    cache.store("1", ["d"], [vec(1)], [1])  # a dense vector fits beside them
    assert len(cache) == 3 and cache.forget("1") == 3 and cache.nbytes == 0


def test_stored_vectors_are_copies_not_views_of_the_batch() -> None:
    batch = np.arange(8, dtype=np.float32).reshape(2, 4)
    cache = ResultCache(10)
    cache.store("1", ["a", "b"], list(batch), [1, 1])
    stored = cache.lookup("1", ["a"])[0][0]
    assert stored.base is None  # owns its memory: the batch array can be freed
    batch[0, 0] = 99
    assert stored[0] == 0


def test_size_and_hit_rate_are_exported() -> None:
    metrics = Metrics()
    cache = ResultCache(3, metrics)
    cache.store("1", ["a", "b", "c", "d"], [vec(i) for i in range(4)], [1] * 4)
    cache.lookup("1", ["a", "d", "e"])
    sample = metrics.registry.get_sample_value
    assert sample("inferd_cache_entries", {"cache": "embeddings"}) == 3
    assert sample("inferd_cache_hits_total", {"cache": "embeddings"}) == 1  # "a" was evicted by "d"
    assert sample("inferd_cache_misses_total", {"cache": "embeddings"}) == 2


def make_engine(tmp_path: Path, handler: HashHandler, max_entries: int) -> EngineKit:
    # oversize=reject with a small budget gives an input error raised on the texts sent on to the queue.
    settings = make_settings(tmp_path, batching={"max_batch_tokens": 64, "oversize": "reject"},
                             cache={"max_entries": max_entries})
    return EngineKit(settings, handler)


def test_engine_answers_repeated_texts_from_the_cache_without_computing_them(tmp_path: Path) -> None:
    handler = HashHandler()
    kit = make_engine(tmp_path, handler, max_entries=100)
    engine = kit.engine

    async def scenario() -> None:
        first = await engine.process(engine.request(["the cat", "a dog"]))
        again = await engine.process(engine.request(["a dog", "new text", "the cat"]))
        # Only the new text reached the model the second time; the answer is whole and in order.
        assert [t for b in handler.batches for t in b].count("a dog") == 1
        assert [t for b in handler.batches for t in b].count("new text") == 1
        for text, got in zip(["a dog", "new text", "the cat"], again.outputs, strict=True):
            assert np.allclose(got, vector_for(text))
        assert again.tokens == [first.tokens[1], again.tokens[1], first.tokens[0]]
        assert again.timings["cache_hits"] == 2
        # An input error in the uncached part names the position in the request, not in what was sent on.
        with pytest.raises(EngineError) as refused:
            await engine.process(engine.request(["the cat", "a dog", "x" * 200]))
        err = refused.value
        assert (err.kind, err.code, err.index) == (Kind.TOO_LONG, "too_many_tokens", 2)

    kit.run(scenario)


def test_a_pairs_key_carries_each_documents_truncation_choices() -> None:
    plain = cache_key(("query", "a long document"), PLAIN)
    keys = {plain, cache_key(("query", "a long document"), TextOptions(direction="left")),
            cache_key(("query", "a long document"), TextOptions(truncate=False))}
    assert len(keys) == 3  # cut from the left, or refused when too long: neither may be answered as the default
    assert cache_key(("query", "a long document"), TextOptions()) == plain  # no choice made: the same entry
    assert cache_key("text", PLAIN) == "text"  # a plain text's key is the text, as before the options existed
    assert cache_key("text", PLAIN) != cache_key("text", TextOptions(direction="left"))


def test_a_text_s_several_outputs_are_kept_as_they_are_and_own_their_memory() -> None:
    from inferd.core.outputs import SparseVector, TextOutputs

    batch = np.arange(12, dtype=np.float32).reshape(2, 6)
    out = TextOutputs(dense=batch[0], sparse=SparseVector(np.array([3, 7]), np.array([0.5, 1.5], dtype=np.float32)),
                      multivector=batch[1].reshape(2, 3))
    cache = ResultCache(4)
    cache.store("load", ["text"], [out], [5])
    (kept, tokens), = cache.lookup("load", ["text"]).values()
    assert isinstance(kept, TextOutputs) and tokens == 5
    assert kept.dense.tolist() == batch[0].tolist() and kept.multivector.tolist() == batch[1].reshape(2, 3).tolist()
    assert kept.sparse.indices.tolist() == [3, 7] and kept.dense.base is None and kept.multivector.base is None
