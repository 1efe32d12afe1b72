"""A request's options for its texts, one typed value travelling beside the texts (plain ``str``) from the route to
the handler's tokeniser: the texts are what the model reads, the options how each is encoded.

``TextOptions`` is what one text asks beyond the model's own settings; ``InputOptions`` is a request's: one value
every input shares (each route's case: the texts of a request are encoded alike), or one per input (TEI's gRPC
RerankStream, whose messages each choose their own cut). Admission adds what is decided on the model load that
runs the request (the outputs asked and the prompt, ``chosen``) once per request, not once per text; the result
cache keys each text by its value and ``key_suffix`` (core/cache.py), so a text with the default options is keyed
as the plain text. Of a (query, document) pair, the options are the document's (core/preprocess.py PairEncoder).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

Direction = Literal["right", "left"]


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How one text is encoded beyond the model's settings; the defaults encode it as those settings say.

    ``prompt`` is the prompt already prepended to the text (the value tokenised: the result cache, keyed by the
    value, never answers a prompted text with an unprompted one's vector); ``direction`` the side cut from a text
    that is too long (``left`` keeps its end, and the prompt); ``truncate`` overrides ``model.truncate``;
    ``max_tokens`` cuts below the model's limit; ``outputs`` names the outputs asked of a model with more than a
    dense head (core/outputs.py OUTPUTS; None: its default ones); ``role`` "query" asks a late-interaction model
    for a query's encoding (its marker and expansion: core/outputs.py is_query), anything else a document's.
    """

    prompt: str = ""
    direction: Direction = "right"
    truncate: bool | None = None
    max_tokens: int | None = None
    outputs: tuple[str, ...] | None = None
    role: str | None = None
    # What a result cache key adds to the text's value: the choices that can change its answer or its refusal
    # when it is too long (the side cut, truncate, max_tokens, where the prompt ends, for a pooling that leaves it
    # out), the outputs asked (an entry holds only those) and the role; "" for the defaults. Made once per value.
    key_suffix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plain = (not self.prompt and self.direction == "right" and self.truncate is None and self.max_tokens is None
                 and self.outputs is None and self.role is None)
        object.__setattr__(self, "key_suffix", "" if plain else (
            f"\x00{len(self.prompt)}:{self.direction}:{self.truncate}:{self.max_tokens}:{self.outputs}:{self.role}"))

    @property
    def cut_by_hand(self) -> bool:
        """Cut from the whole text's tokens (core/preprocess.py TextEncoder), not by the tokenizer's own right-side
        truncation."""
        return self.direction == "left" or self.max_tokens is not None

    def chosen(self, outputs: tuple[str, ...] | None, prompt: str) -> TextOptions:
        """These options with the model load's choices: ``outputs`` (None: keep this text's) and ``prompt`` (""
        : keep this text's), prepended to the text by the caller."""
        if outputs is None and not prompt:
            return self
        return replace(self, prompt=prompt or self.prompt, outputs=self.outputs if outputs is None else outputs)


PLAIN = TextOptions()


@dataclass(frozen=True, slots=True)
class InputOptions:
    """A request's text options: ``shared`` by every input, or (``each``) one per input, in order."""

    shared: TextOptions = PLAIN
    each: tuple[TextOptions, ...] | None = None

    @classmethod
    def of(cls, options: Sequence[TextOptions]) -> InputOptions:
        """One per input, held as one shared value when they are all equal (every text of the request alike)."""
        first = options[0] if options else PLAIN
        if all(o == first for o in options):
            return cls(first)
        return cls(each=tuple(options))

    def __getitem__(self, i: int) -> TextOptions:
        return self.shared if self.each is None else self.each[i]

    def per_text(self, n: int) -> Sequence[TextOptions]:
        """The options of each of ``n`` inputs, in order."""
        return (self.shared,) * n if self.each is None else self.each

    @property
    def plain(self) -> bool:
        """Every input encoded as the model's settings say."""
        return self.each is None and not self.shared.key_suffix

    def taking(self, indices: Iterable[int]) -> InputOptions:
        """The options of the inputs at ``indices``, in that order (the cache's misses, a document's pieces, a
        wave); a shared value is kept as it is, ``indices`` left unread."""
        if self.each is None:
            return self
        return InputOptions(each=tuple(self.each[i] for i in indices))

    def mapped(self, change: Callable[[TextOptions], TextOptions]) -> InputOptions:
        """Each input's options changed by ``change`` (once per distinct value)."""
        if self.each is None:
            return InputOptions(change(self.shared))
        done: dict[TextOptions, TextOptions] = {}
        return InputOptions(each=tuple(done[o] if o in done else done.setdefault(o, change(o)) for o in self.each))

    def chosen(self, outputs: tuple[str, ...] | None, prompt: str) -> InputOptions:
        """Every input's options with the model load's choices (TextOptions.chosen)."""
        if outputs is None and not prompt:
            return self
        return self.mapped(lambda o: o.chosen(outputs, prompt))


PLAIN_INPUTS = InputOptions()
