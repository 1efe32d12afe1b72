"""A late-interaction model (ColBERT, bge-m3's token vectors) served as a reranker: (query, document) pairs in,
one score per pair out, the MaxSim of the query's token vectors against the document's (core/outputs.py maxsim),
so /rerank, /v1/rerank and /v2/rerank rank with it as they rank with a cross-encoder.

It wraps the model's own multi-vector handler: each batch runs its documents and (once each) its distinct queries
through one forward pass of that handler, asking for the token vectors only. A pair's token cost is its
document's and its query's. The score has no activation: ``[score, score]`` answers both the activated and the
raw column the rerank routes read (TEI's ``raw_scores``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from inferd.core.description import Loaded, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.outputs import TextOutputs, maxsim
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler, TokenVectorTask
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions

_ASK = ("multivector",)
# A query asks for its token vectors, encoded as a query (its marker and expansion).
_QUERY = TextOptions(outputs=_ASK, role="query")


@dataclass(frozen=True, slots=True)
class ScoredPair(Encoded):
    """A pair to score: its document's encoding (whose ids the batch's padding counts) and its query's."""

    query: Encoded | None = None
    document: Encoded | None = None

    @property
    def tokens(self) -> int:
        assert self.query is not None
        return len(self.ids) + self.query.tokens


def _document(options: TextOptions) -> TextOptions:
    """A document's options: its token vectors asked for, cut as its request chose (its side and truncate)."""
    return TextOptions(direction=options.direction, truncate=options.truncate, outputs=_ASK)


class LateInteractionRerankHandler(Handler):
    """MaxSim scores of (query, document) pairs from a multi-vector model (``inner``: its embedding handler)."""

    task = "rerank"
    inputs = "pairs"

    def __init__(self, inner: TokenVectorTask) -> None:
        self.inner = inner
        self._room: int | None = None

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        inner = self.inner.open(spec, device)
        gives = tuple(inner.facts.other.get("outputs") or ())
        if "multivector" not in gives:
            self.inner.close()
            raise ModelLoadError(f"{spec.path} gives no token vectors ({', '.join(gives) or 'dense'} only): a "
                                 "model served as a late-interaction reranker needs a multi-vector output")
        # The load is the inner handler's (its passes, device and tokenizer); the facts are a reranker's.
        return replace(inner, facts=TaskFacts(other={
            "scoring": "maxsim", "multivector_dimension": inner.facts.other.get("multivector_dimension")}))

    def document_room(self, query: str) -> int | None:
        """A document is encoded apart from its query, up to the model's document length: what an endless text
        keeps of its own tokens (markers and special tokens left out)."""
        if self._room is None:
            long, one = self.inner.encode_texts(["a " * 4096, "a"], InputOptions(each=(
                TextOptions(truncate=True, outputs=_ASK), TextOptions(outputs=_ASK))))
            self._room = long.tokens - (one.tokens - 1)
        return self._room

    def preprocess(self, pairs: list[tuple[str, str]], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        """Each pair's query (once each) and document tokenised, the document cut as its options say."""
        queries = {q: i for i, q in enumerate(dict.fromkeys(q for q, _ in pairs))}
        docs = options.mapped(_document).per_text(len(pairs))
        # encode_texts, not preprocess: the answer is a score per pair, not the token vectors, so their limit
        # (limits.max_multivector_tokens) is not this request's.
        encoded = self.inner.encode_texts([*queries, *(d for _, d in pairs)],
                                          InputOptions(each=(_QUERY,) * len(queries) + tuple(docs)))
        asked, documents = encoded[: len(queries)], encoded[len(queries):]
        return [ScoredPair(d.ids, d.truncated, query=asked[queries[q]], document=d)
                for (q, _), d in zip(pairs, documents, strict=True)]

    def preprocess_with(self, inputs: list[Any], options: InputOptions) -> list[Encoded]:
        return self.preprocess(inputs, options)

    def infer(self, batch: list[Encoded]) -> list[float]:
        queries: dict[int, int] = {}  # one forward row per distinct query encoding in the batch
        rows: list[Encoded] = []
        for pair in batch:
            assert isinstance(pair, ScoredPair) and pair.query is not None and pair.document is not None
            if id(pair.query) not in queries:
                queries[id(pair.query)] = len(rows)
                rows.append(pair.query)
        first_doc = len(rows)
        rows.extend(p.document for p in batch if isinstance(p, ScoredPair) and p.document is not None)
        vectors = [o.multivector if isinstance(o, TextOutputs) else None
                   for o in self.inner.postprocess(self.inner.infer(rows))]
        scores = []
        for j, pair in enumerate(batch):
            assert isinstance(pair, ScoredPair)
            query, document = vectors[queries[id(pair.query)]], vectors[first_doc + j]
            if query is None or document is None:
                raise RuntimeError("the multi-vector handler answered without token vectors")
            scores.append(maxsim(query, document))
        return scores

    def postprocess(self, outputs: list[float]) -> list[np.ndarray]:
        return [np.array([s, s], dtype=np.float32) for s in outputs]

    def warmup(self) -> None:
        self.infer(self.preprocess([("warm up", "a document"), ("warm up", "a longer document to pad")]))

    def close(self) -> None:
        self.inner.close()
