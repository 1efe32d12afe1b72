"""Long-document rerank: a (query, document) pair whose document does not fit beside its query is scored piece by
piece, and the document gets its best piece's score (``max``; ``mean``: the mean of its pieces' scores), so a
reranker sees the passage that matters wherever it sits, not only the first few hundred tokens a cut keeps.

A document is split (core/chunking.py, the embedding pieces' splitter) into pieces sized to the room the reranker
leaves beside the query (``Handler.document_room``: a cross-encoder's limit less the query and its special tokens,
an LLM reranker's less its template and instruction, a late-interaction model's document length), or
``max_tokens`` when asked and it fits; a document that fits is sent as it is, so its score is the one an unsplit
request gives. Every piece is an ordinary (query, piece) pair through admission (core/pieces.py's waves: cache,
tenant budget charged every piece's tokens, priority, deadline, batches), counted against the documents' limits
(``limits.max_document_pieces``, ``limits.max_request_pieces``). The answer for each pair is the chosen row, which
the rerank routes read as they read any pair's, carrying which span scored (``ScoredDocument``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.core.chunking import Chunking, Piece, split_within
from inferd.core.errors import EngineError, Kind
from inferd.core.late_chunking import untruncated
from inferd.core.outcomes import TaskResult, merged_timings
from inferd.core.slots import ModelSlot

# How a document's pieces' scores make its score.
MAX, MEAN = "max", "mean"
MODES = (MAX, MEAN)


class ScoredDocument(np.ndarray):
    """A pair's row ([score, raw], as the reranker answers one), and which of its document's pieces it came from:
    ``start``, ``end`` (``document[start:end]`` is the span whose score it is; for ``mean``, the best one's) and
    ``pieces`` (how many the document was scored in)."""

    start: int
    end: int
    pieces: int

    @classmethod
    def of(cls, row: np.ndarray, piece: Piece, pieces: int) -> ScoredDocument:
        out = np.asarray(row, dtype=np.float32).view(cls)
        out.start, out.end, out.pieces = piece.start, piece.end, pieces
        return out

    def span(self) -> dict[str, int]:
        return {"start": int(self.start), "end": int(self.end), "pieces": int(self.pieces)}


def span_of(output: Any) -> dict[str, int] | None:
    """Which span of its document a pair's score came from (None: the document was not split)."""
    return output.span() if isinstance(output, ScoredDocument) else None


def combine(rows: Sequence[np.ndarray], mode: str) -> tuple[np.ndarray, int]:
    """One document's row from its pieces' rows, and the index of the piece that scored best."""
    stacked = np.asarray(np.stack([np.asarray(r, dtype=np.float64) for r in rows]))
    best = int(np.argmax(stacked[:, 0]))
    row = stacked[best] if mode == MAX else stacked.mean(axis=0)
    return row.astype(np.float32), best


@dataclass(frozen=True)
class Plan:
    """Each pair's pieces (one whole-document piece when it fits: sent unchanged) and whether it was split."""

    pieces: list[list[Piece]]
    split: list[bool]


def refusal(chunking: Chunking) -> EngineError | None:
    """A mode that does not score pairs (pooled, pieces and late embed texts)."""
    if chunking.mode in MODES:
        return None
    return EngineError(Kind.INVALID_INPUT, f"a (query, document) pair's pieces are scored and combined by "
                       f"{' or '.join(MODES)}, not {chunking.mode!r}", "invalid_value", field="chunking.mode")


def plan(pairs: Sequence[tuple[Any, Any]], slot: ModelSlot, chunking: Chunking, max_document: int,
         max_request: int) -> Plan:
    """The pieces of every pair's document (refusing a query with no room, pieces larger than the room, and a
    document or request over the pieces limits)."""
    handler = slot.handler
    tokenizer = slot.loaded.tokenizer
    rooms: dict[str, int | None] = {}
    out: list[list[Piece]] = []
    was_split: list[bool] = []
    total = 0
    for i, (query, document) in enumerate(pairs):
        q = str(query)
        if q not in rooms:
            rooms[q] = handler.document_room(q)
        room = rooms[q]
        if room is None or tokenizer is None:
            raise EngineError(Kind.INVALID_INPUT, f"model {slot.description.name!r} cannot score a document piece "
                              "by piece: it does not say how much of a document fits beside a query",
                              "chunking_unsupported", field="chunking")
        if room <= 0:
            raise EngineError(Kind.TOO_LONG, "the query leaves no room for a document in the model's limit of "
                              f"{slot.description.max_seq_length} tokens; send a shorter query",
                              "context_length_exceeded", index=i, field="query")
        size = chunking.max_tokens or room
        if size > room:
            raise EngineError(Kind.INVALID_INPUT, f"pieces of {size} tokens do not fit model "
                              f"{slot.description.name!r} beside this query: {room} tokens are left",
                              "chunk_too_large", field="chunking.max_tokens")
        if chunking.overlap >= size:
            raise EngineError(Kind.INVALID_INPUT, f"overlap ({chunking.overlap} tokens) must be less than the "
                              f"piece size ({size} tokens)", "overlap_too_large", field="chunking.overlap")
        text = str(document)
        if len(untruncated(tokenizer).encode(text, add_special_tokens=False).ids) <= size:
            out.append([Piece(0, len(text), 0)])
            was_split.append(False)
            continue
        found = split_within(text, tokenizer, max_tokens=size, overlap=chunking.overlap, per_document=max_document,
                             left=max_request - total, index=i)
        total += len(found)
        out.append(found or [Piece(0, len(text), 0)])
        was_split.append(bool(found))
    return Plan(out, was_split)


def scored(plan_: Plan, results: list[TaskResult], mode: str, description: Any) -> TaskResult:
    """Each pair's row: its document's own, or its pieces' combined (a ScoredDocument)."""
    rows = [o for r in results for o in r.outputs]
    tokens = [n for r in results for n in r.tokens]
    answers: list[Any] = []
    counts: list[int] = []
    at = 0
    for found, was_split in zip(plan_.pieces, plan_.split, strict=True):
        mine = rows[at:at + len(found)]
        if was_split:
            row, best = combine(mine, mode)
            answers.append(ScoredDocument.of(row, found[best], len(found)))
        else:
            answers.append(mine[0])
        counts.append(sum(tokens[at:at + len(found)]))
        at += len(found)
    timings = merged_timings(results)
    return TaskResult(answers, counts, description, timings, results[0].calibration)
