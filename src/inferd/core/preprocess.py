"""Input checks and tokenisation, on the CPU, before anything queues.

Kept apart from the model so it can be tested with a tokenizer built in memory, no weights needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer


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
    """One text, tokenised: the ids the model sees (special tokens included)."""

    ids: list[int]
    truncated: bool

    @property
    def tokens(self) -> int:
        return len(self.ids)


class TextEncoder:
    """Wraps a fast (Rust) tokenizer: one call per request, truncation or refusal past the limit."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, truncate: bool) -> None:
        self._tok = tokenizer
        self.max_length = max_length
        self.truncate = truncate
        self._tok.no_padding()
        # The tokenizer's own truncation keeps the special tokens right; ``overflowing`` tells us it cut.
        self._tok.enable_truncation(max_length)

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        encodings = self._tok.encode_batch(list(texts)) if len(texts) > 1 else [self._tok.encode(texts[0])]
        out = []
        for i, enc in enumerate(encodings):
            truncated = bool(enc.overflowing)
            if truncated and not self.truncate:
                raise InputError(
                    i, f"is longer than the model's limit of {self.max_length} tokens (truncation is off)",
                    "context_length_exceeded")
            out.append(Encoded(enc.ids, truncated))
        return out
