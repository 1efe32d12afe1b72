"""Input checks and tokenisation, on the CPU, before anything queues.

Kept apart from the model so it can be tested with a tokenizer built in memory, no weights needed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Encoding, Tokenizer

from inferd.core.text_options import PLAIN_INPUTS, Direction, InputOptions, TextOptions


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
        # The limit is on what the client sent: the prompt is the model's, prepended after this check, on the load
        # that runs the request (its load refuses one longer than the limit, core/tasks/embedding.py check_prompts).
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
    # Leading tokens pooling leaves out: the prompt's, on a model whose pooling excludes it (include_prompt).
    skip: int = 0

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

    A text's options (core/text_options.py TextOptions) may ask for the other side (``left``) or a shorter limit
    (``max_tokens``): those texts are tokenised whole (at most ``limits.max_chars_per_text``) and cut by hand,
    keeping the special tokens and the prompt: ``[CLS] prompt …end of the text [SEP]``. ``exclude_prompt`` (a
    pooling with ``include_prompt: false``) marks a prompt's tokens to be left out of pooling (``Encoded.skip``),
    counted as sentence-transformers counts them: the prompt tokenised alone, less a trailing special token.
    """

    def __init__(self, tokenizer: Tokenizer, max_length: int, truncate: bool, exclude_prompt: bool = False) -> None:
        self._tok = tokenizer
        self.max_length = max_length
        self.truncate = truncate
        self.exclude_prompt = exclude_prompt
        self.prefix_chars = max(64, CHARS_PER_TOKEN * max_length)
        self._tok.no_padding()
        # The tokenizer's own truncation keeps the special tokens right; ``overflowing`` tells us it cut.
        self._tok.enable_truncation(max_length)
        # Built on first use (most requests never need it): a copy that never truncates, for texts cut by hand,
        # the prompt's own length and /tokenize. A tokenizer's truncation is its state, shared by threads.
        self._whole_tok: Tokenizer | None = None
        self._edges: tuple[int, int] = (0, 0)
        self._prompt_tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def whole(self) -> Tokenizer:
        """The tokenizer without truncation."""
        if self._whole_tok is None:
            with self._lock:
                if self._whole_tok is None:
                    tok = Tokenizer.from_str(self._tok.to_str())
                    tok.no_padding()
                    tok.no_truncation()
                    # Where the special tokens of one text go: before and after its own tokens.
                    mask = tok.encode("a").special_tokens_mask
                    content = [i for i, m in enumerate(mask) if not m]
                    self._edges = (content[0], len(mask) - 1 - content[-1]) if content else (0, 0)
                    self._whole_tok = tok
        return self._whole_tok

    def prompt_tokens(self, prompt: str) -> int:
        """Tokens of a prompt as sentence-transformers counts them for pooling: alone, with the special tokens,
        less a trailing special one (the leading ones are left out of pooling with it)."""
        n = self._prompt_tokens.get(prompt)
        if n is None:
            enc = self.whole.encode(prompt)
            n = len(enc.ids) - (1 if enc.special_tokens_mask and enc.special_tokens_mask[-1] else 0)
            self._prompt_tokens[prompt] = n
        return n

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

    def encode(self, texts: Sequence[str], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        """Each text encoded as its options (``options``, in order) say: the model's settings, by default."""
        out: list[Encoded | None] = [None] * len(texts)
        each = options.per_text(len(texts))
        by_hand = [i for i, o in enumerate(each) if o.cut_by_hand]
        fast: Sequence[int] = [i for i, o in enumerate(each) if not o.cut_by_hand] if by_hand else range(len(texts))
        if fast:
            for i, enc in zip(fast, self._encode_cut([texts[i] for i in fast]), strict=True):
                o = each[i]
                truncate = self.truncate if o.truncate is None else o.truncate
                skip = self.prompt_tokens(o.prompt) if o.prompt and self.exclude_prompt else 0
                out[i] = self._checked(i, enc.ids, bool(enc.overflowing), truncate, min(skip, len(enc.ids)))
        if by_hand:
            whole = self.whole.encode_batch([texts[i] for i in by_hand])
            for i, enc in zip(by_hand, whole, strict=True):
                out[i] = self._cut(i, each[i], enc)
        return out  # type: ignore[return-value]

    def _checked(self, i: int, ids: list[int], truncated: bool, truncate: bool, skip: int,
                 limit: int | None = None) -> Encoded:
        if truncated and not truncate:
            what = f"the limit of {limit} tokens asked" if limit else f"the model's limit of {self.max_length} tokens"
            raise InputError(i, f"is longer than {what} (truncation is off)", "context_length_exceeded")
        return Encoded(ids, truncated, skip=skip)

    def _cut(self, i: int, options: TextOptions, enc: Encoding) -> Encoded:
        """A whole text's tokens cut to its limit on its side, special tokens and prompt kept."""
        truncate = self.truncate if options.truncate is None else options.truncate
        prompt = options.prompt
        limit = min(self.max_length, options.max_tokens or self.max_length)
        ids = enc.ids
        lead, trail = self._edges
        content = ids[lead: len(ids) - trail]
        # The prompt's tokens: those that start inside it (offsets are characters of the value, prompt first).
        n_prompt = sum(1 for start, _ in enc.offsets[lead: len(ids) - trail] if start < len(prompt)) if prompt else 0
        truncated = len(ids) > limit
        if truncated:
            room = max(1, limit - lead - trail)
            if options.direction == "right":
                kept = content[:room]
                kept_prompt = min(n_prompt, room)
            elif room > n_prompt:
                kept = content[:n_prompt] + content[len(content) - (room - n_prompt):]
                kept_prompt = n_prompt
            else:  # the prompt alone fills the limit: only its end remains
                kept = content[len(content) - room:]
                kept_prompt = max(0, n_prompt - (len(content) - room))
            ids = ids[:lead] + kept + ids[len(ids) - trail:]
        else:
            kept_prompt = n_prompt
        skip = lead + kept_prompt if prompt and self.exclude_prompt and kept_prompt else 0
        return self._checked(i, ids, truncated, truncate, skip, limit if limit < self.max_length else None)


class PairEncoder:
    """(query, document) pairs, each one input: ``[CLS] query [SEP] document [SEP]`` with segment ids.

    A pair too long for the model loses its document's end first (``only_second``): the query is what every
    document is judged against. Only a query that leaves no room for any document is cut too
    (``longest_first``), as the reference cross-encoder would. A document's options (core/text_options.py
    TextOptions) are its request's choices: ``truncate`` overrides ``model.truncate`` (false refuses the pair),
    ``direction`` left cuts the document's start instead, keeping its end (and the start of a query that alone
    fills the limit), as the tokenizer cuts with ``truncation_side`` left. One tokenizer per strategy and side,
    made on first use: a tokenizer's truncation is its state, and preprocessing may run in several threads at once.
    """

    def __init__(self, tokenizer: Tokenizer, max_length: int, truncate: bool) -> None:
        self.max_length = max_length
        self.truncate = truncate
        self._source = tokenizer.to_str()
        self._tokenizers: dict[tuple[str, Direction], Tokenizer] = {}
        self._lock = threading.Lock()
        self._specials = self._tokenizer("only_second", "right").num_special_tokens_to_add(is_pair=True)

    def _tokenizer(self, strategy: str, direction: Direction) -> Tokenizer:
        tok = self._tokenizers.get((strategy, direction))
        if tok is None:
            with self._lock:
                tok = self._tokenizers.get((strategy, direction))
                if tok is None:
                    tok = Tokenizer.from_str(self._source)
                    tok.no_padding()
                    tok.enable_truncation(self.max_length, strategy=strategy, direction=direction)
                    self._tokenizers[(strategy, direction)] = tok
        return tok

    def room(self, query: str) -> int:
        """The document tokens that fit beside ``query`` (0: the query alone fills the limit)."""
        query_tokens = len(self._tokenizer("longest_first", "right").encode(query, add_special_tokens=False).ids)
        return max(0, self.max_length - self._specials - query_tokens)

    def encode(self, pairs: Sequence[tuple[str, str]], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        """Each pair encoded as its document's options (``options``, in order) say."""
        out: list[Encoded | None] = [None] * len(pairs)
        longest = self._tokenizer("longest_first", "right")
        # A query's own length decides the strategy; a rerank request has one query for all its documents.
        # (Measured with the longest_first tokenizer: only_second refuses a lone text; it stops at max_length.)
        fits = {q: len(longest.encode(q, add_special_tokens=False).ids) + self._specials < self.max_length
                for q in {q for q, _ in pairs}}
        each = options.per_text(len(pairs))
        groups: dict[tuple[str, Direction], list[int]] = {}
        for i, (query, _) in enumerate(pairs):
            side = each[i].direction
            groups.setdefault(("only_second" if fits[query] else "longest_first", side), []).append(i)
        for (strategy, side), rows in groups.items():
            encodings = self._tokenizer(strategy, side).encode_batch([pairs[i] for i in rows])
            for i, enc in zip(rows, encodings, strict=True):
                truncated = bool(enc.overflowing)
                if truncated and not (self.truncate if each[i].truncate is None else each[i].truncate):
                    raise InputError(i, f"the query and this document are longer than the model's limit of "
                                     f"{self.max_length} tokens (truncation is off)", "context_length_exceeded")
                out[i] = Encoded(enc.ids, truncated, enc.type_ids)
        return out  # type: ignore[return-value]
