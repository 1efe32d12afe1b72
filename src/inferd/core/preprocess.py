"""Input checks and tokenisation, on the CPU, before anything queues.

Kept apart from the model so it can be tested with a tokenizer built in memory, no weights needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Encoding, Tokenizer


class InputError(Exception):
    """One input is unusable; ``index`` says which, so the API can name the field."""

    def __init__(self, index: int | None, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.index = index
        self.message = message
        self.code = code


def check_texts(texts: Sequence[object], max_items: int, max_chars: int) -> list[str]:
    """Cheap checks that need no tokenizer: types, emptiness, counts, absurd lengths."""
    if len(texts) == 0:
        raise InputError(None, "at least one text is required", "empty_input")
    if len(texts) > max_items:
        raise InputError(None, f"{len(texts)} texts given; at most {max_items} per request",
                         "too_many_items")
    out: list[str] = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(i, f"must be a string, not {type(text).__name__}", "invalid_type")
        if not text.strip():
            raise InputError(i, "must not be empty or only whitespace", "empty_string")
        if len(text) > max_chars:
            raise InputError(i, f"is {len(text)} characters long; the limit is {max_chars}", "text_too_long")
        out.append(text)
    return out


@dataclass(frozen=True, slots=True)
class Encoded:
    """One input (a text, or a query/document pair), tokenised: the ids the model sees (special tokens
    included) and, for a pair, which segment each id belongs to (``type_ids``)."""

    ids: list[int]
    truncated: bool
    type_ids: list[int] | None = None

    @property
    def tokens(self) -> int:
        return len(self.ids)


# Characters tokenised per token kept, before checking that the cut changed nothing (see TextEncoder).
# English prose runs at ~4-5 characters a WordPiece token, Chinese and symbols at ~1: six covers prose with
# room to spare; a text that needs more (long words, runs of characters that make no token) is retried.
CHARS_PER_TOKEN = 6
# Each retry tokenises this many times more of the text, up to all of it.
GROWTH = 4


def _max_word(encodings: Sequence[Encoding]) -> int:
    return max((w for e in encodings for w in e.word_ids if w is not None), default=-1)


class TextEncoder:
    """Wraps a fast (Rust) tokenizer: one call per request, truncation or refusal past the limit.

    Only ``max_length`` tokens of a text are kept, so tokenising all of a 20,000-character text is waste
    (and a way to tie up the CPU): a long text is tokenised from a prefix of ``CHARS_PER_TOKEN`` characters
    per token, and the prefix is trusted only when it provably gives what the whole text would. The
    tokenizer splits text into words (pre-tokens) and tokenises each word alone; normalisation (lower
    case, accents, Unicode forms, stripped control characters) acts on a character and its neighbours. So
    cutting the text can change only the prefix's last word: if every kept token comes from an earlier
    word, the kept tokens are the whole text's. When that does not hold (the prefix made too few tokens —
    whitespace, control characters or combining marks make none — or its last word reaches into the kept
    tokens, as a text with no word boundaries always does) a longer prefix is tried, up to the whole text.
    """

    def __init__(self, tokenizer: Tokenizer, max_length: int, truncate: bool) -> None:
        self._tok = tokenizer
        self.max_length = max_length
        self.truncate = truncate
        self.prefix_chars = max(64, CHARS_PER_TOKEN * max_length)
        self._tok.no_padding()
        # The tokenizer's own truncation keeps the special tokens right; ``overflowing`` tells us it cut.
        self._tok.enable_truncation(max_length)

    def _encode_all(self, texts: list[str]) -> list[Encoding]:
        return self._tok.encode_batch(texts) if len(texts) > 1 else [self._tok.encode(texts[0])]

    def _encode_cut(self, texts: Sequence[str]) -> list[Encoding]:
        out: list[Encoding | None] = [None] * len(texts)
        todo = list(range(len(texts)))
        cut = self.prefix_chars
        while todo:
            encodings = self._encode_all([texts[i][:cut] for i in todo])
            retry = []
            for i, enc in zip(todo, encodings, strict=True):
                whole = len(texts[i]) <= cut
                # Safe: the prefix made more tokens than are kept, and the kept ones end before its last word.
                if whole or (enc.overflowing and _max_word([enc]) < _max_word(enc.overflowing)):
                    out[i] = enc
                else:
                    retry.append(i)
            todo, cut = retry, cut * GROWTH
        return out  # type: ignore[return-value]

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        encodings = self._encode_cut(texts)
        out = []
        for i, enc in enumerate(encodings):
            truncated = bool(enc.overflowing)
            if truncated and not self.truncate:
                raise InputError(
                    i, f"is longer than the model's limit of {self.max_length} tokens (truncation is off)",
                    "context_length_exceeded")
            out.append(Encoded(enc.ids, truncated))
        return out


class PairEncoder:
    """(query, document) pairs, each one input: ``[CLS] query [SEP] document [SEP]`` with segment ids.

    A pair too long for the model loses the end of its document first (``only_second``): the query is
    what every document is judged against. Only a query that leaves no room for any document is cut too
    (``longest_first``), as the reference cross-encoder would. Two tokenizers, one per strategy: a
    tokenizer's truncation is its state, and preprocessing may run in several threads at once.
    """

    def __init__(self, tokenizer: Tokenizer, max_length: int, truncate: bool) -> None:
        self.max_length = max_length
        self.truncate = truncate
        self._second = Tokenizer.from_str(tokenizer.to_str())
        self._longest = Tokenizer.from_str(tokenizer.to_str())
        for tok, strategy in ((self._second, "only_second"), (self._longest, "longest_first")):
            tok.no_padding()
            tok.enable_truncation(max_length, strategy=strategy)
        self._specials = self._second.num_special_tokens_to_add(is_pair=True)

    def encode(self, pairs: Sequence[tuple[str, str]]) -> list[Encoded]:
        out: list[Encoded | None] = [None] * len(pairs)
        queries = {q for q, _ in pairs}
        # A query's own length decides the strategy; a rerank request has one query for all its documents.
        # (Measured with the longest_first tokenizer: only_second refuses a lone text; it stops at max_length.)
        fits = {q: len(self._longest.encode(q, add_special_tokens=False).ids) + self._specials < self.max_length
                for q in queries}
        for strategy, tok in ((True, self._second), (False, self._longest)):
            rows = [i for i, (q, _) in enumerate(pairs) if fits[q] is strategy]
            if not rows:
                continue
            encodings = tok.encode_batch([pairs[i] for i in rows])
            for i, enc in zip(rows, encodings, strict=True):
                truncated = bool(enc.overflowing)
                if truncated and not self.truncate:
                    raise InputError(i, f"the query and this document are longer than the model's limit of "
                                     f"{self.max_length} tokens (truncation is off)", "context_length_exceeded")
                out[i] = Encoded(enc.ids, truncated, enc.type_ids)
        return out  # type: ignore[return-value]
