"""Splitting a long text into pieces that fit a model's window, counted with the model's own tokenizer.

The splitter is ``semantic-text-splitter`` (Rust): it splits at the largest semantic unit that fits (paragraph,
then sentence, then word, then grapheme), fills each piece up to the budget, overlaps in tokens, and hands back
character offsets into the original text. Measured against ``semchunk`` on documents of 60k-110k MiniLM tokens
(prose, Chinese with emoji, one line with no punctuation; 254-token pieces, 16 overlap): both gave offsets that
slice the original exactly and no piece over budget, at a similar speed (0.4-1.2 s per document on one core);
semantic-text-splitter fills pieces fuller (567 pieces against 608 for the same 110k-token document, so fewer
forward passes) and counts tokens in Rust rather than through a Python callback per candidate. See
docs/long-documents.md.

``tokens`` of a piece is counted again on the piece alone (no special tokens): that is what the model will see
when the piece runs as its own input, which is the figure the scheduler and the pooling weights need.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from semantic_text_splitter import TextSplitter
from tokenizers import Tokenizer

from inferd.core.errors import EngineError, Kind

# How a document's pieces are answered: one vector per document (pooled over its pieces), or every piece; or every
# piece pooled from the token states of one pass over the window around it (core/late_chunking.py).
LATE = "late"
# A (query, document) pair's document scored piece by piece, its score its best piece's or their mean
# (core/long_rerank.py).
MODES = ("pooled", "pieces", LATE, "max", "mean")


@dataclass(frozen=True)
class Piece:
    start: int  # character offsets into the ORIGINAL text: text[start:end] is the piece, exactly
    end: int
    tokens: int  # the piece's token count by the model's tokenizer (no special tokens)


@dataclass(frozen=True)
class Chunking:
    """A request's ask to split its texts into pieces that fit the model: ``mode`` (MODES), ``max_tokens`` per
    piece (None: as many as the model's window leaves beside its special tokens and the prompt) and ``overlap``
    in tokens between neighbours. ``check`` holds the rules that need no model (raises EngineError)."""

    mode: str = "pooled"
    max_tokens: int | None = None
    overlap: int = 0

    def check(self) -> Chunking:
        if self.mode not in MODES:
            raise EngineError(Kind.INVALID_INPUT, f"must be one of {list(MODES)}, not {self.mode!r}",
                              "invalid_value", field="chunking.mode")
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens <= 0):
            raise EngineError(Kind.INVALID_INPUT, f"must be a positive integer, not {self.max_tokens!r}",
                              "invalid_value", field="chunking.max_tokens")
        if type(self.overlap) is not int or self.overlap < 0:
            raise EngineError(Kind.INVALID_INPUT, f"must be a non-negative integer, not {self.overlap!r}",
                              "invalid_value", field="chunking.overlap")
        if self.max_tokens is not None and self.overlap >= self.max_tokens:
            raise EngineError(Kind.INVALID_INPUT, f"overlap ({self.overlap} tokens) must be less than the piece "
                              f"size ({self.max_tokens} tokens, chunking.max_tokens)", "overlap_too_large",
                              field="chunking.overlap")
        return self


# A splitter holds its own copy of the tokenizer (truncation and padding off: the handler's copy truncates to the
# window, which would cap every count at the budget). Building one costs a few milliseconds, so they are kept per
# (tokenizer, budget, overlap); the key holds the tokenizer itself so an id is never reused while cached.
_CACHE_SIZE = 16
_splitters: OrderedDict[tuple[int, int, int], tuple[Any, TextSplitter, Tokenizer]] = OrderedDict()
_lock = threading.Lock()


def backend(tokenizer: Any) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer, or the tokenizer itself."""
    return tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer


def _splitter(tokenizer: Any, max_tokens: int, overlap: int) -> tuple[TextSplitter, Tokenizer]:
    key = (id(tokenizer), max_tokens, overlap)
    with _lock:
        hit = _splitters.get(key)
        if hit is not None and hit[0] is tokenizer:
            _splitters.move_to_end(key)
            return hit[1], hit[2]
    counter = Tokenizer.from_str(backend(tokenizer).to_str())
    counter.no_truncation()
    counter.no_padding()
    splitter = TextSplitter.from_huggingface_tokenizer(counter, max_tokens, overlap=overlap)
    with _lock:
        _splitters[key] = (tokenizer, splitter, counter)
        while len(_splitters) > _CACHE_SIZE:
            _splitters.popitem(last=False)
    return splitter, counter


def split(text: str, tokenizer: Any, *, max_tokens: int, overlap: int = 0) -> list[Piece]:
    """``text`` as pieces of at most ``max_tokens`` tokens each (special tokens not counted), consecutive pieces
    sharing up to ``overlap`` tokens. Whitespace between pieces belongs to none; a text of only whitespace has
    no pieces. The caller checks ``0 <= overlap < max_tokens`` (a request error, answered before this)."""
    if not text or text.isspace():
        return []
    splitter, counter = _splitter(tokenizer, max_tokens, overlap)
    spans = [(start, start + len(chunk), chunk) for start, chunk in splitter.chunk_indices(text)]
    counted = counter.encode_batch([chunk for _, _, chunk in spans], add_special_tokens=False)
    return [Piece(start, end, len(enc.ids)) for (start, end, _), enc in zip(spans, counted, strict=True)]


def split_within(text: str, tokenizer: Any, *, max_tokens: int, overlap: int, per_document: int, left: int,
                 index: int) -> list[Piece]:
    """``split``, refused (``too_many_pieces``) when the text makes more than ``per_document`` pieces
    (``limits.max_document_pieces``) or more than the request's ``left`` (``limits.max_request_pieces`` less its
    documents before). Refused before the split where one count of the text's tokens says it would be: the splitter's
    work grows with its pieces (each is counted again), and with an overlap near the piece size a piece adds a token
    or two, so a long text made ~10,000 pieces in 40 s of a core before its count was refused (the guess assumes the
    whole overlap is shared, as the splitter shares it where it can)."""
    if not text or text.isspace():
        return []
    _, counter = _splitter(tokenizer, max_tokens, overlap)
    tokens = len(counter.encode(text, add_special_tokens=False).ids)
    guess = max(1, math.ceil(max(tokens - overlap, 1) / (max_tokens - overlap)))
    _check_count(guess, per_document, left, index, max_tokens, "would split into about")
    found = split(text, tokenizer, max_tokens=max_tokens, overlap=overlap)
    _check_count(len(found), per_document, left, index, max_tokens, "splits into")
    return found


def _check_count(count: int, per_document: int, left: int, index: int, max_tokens: int, verb: str) -> None:
    if count > per_document:
        raise EngineError(Kind.TOO_LONG, f"{verb} {count} pieces of at most {max_tokens} tokens; the limit is "
                          f"{per_document} per document (limits.max_document_pieces)", "too_many_pieces", index=index)
    if count > left:
        raise EngineError(Kind.TOO_LONG, f"{verb} {count} pieces of at most {max_tokens} tokens, beyond the {left} "
                          "the request has left of limits.max_request_pieces", "too_many_pieces", index=index)
