"""Late chunking (Günther et al., 2024, "Late Chunking: Contextual Chunk Embeddings Using Long-Context Embedding
Models"): a document's pieces (core/chunking.py, the same split as chunked embedding) are embedded from ONE forward
pass over as much of the document as the model's window holds, each piece's vector pooled from the token states
inside its span, so every piece carries the context of its neighbours (a pronoun, a heading, an abbreviation
defined three paragraphs earlier). A document longer than the window runs as consecutive windows of whole pieces.

How it runs: the windows are ordinary inputs asking for the model's ``token_states`` (core/tasks/token_states.py),
through admission like any chunked request's pieces (cache, tenant budget charged every window's tokens, priority,
deadline, batches; core/pieces.py's waves, each wave's token states within ``limits.max_multivector_tokens``). Each
window is tokenised here once more, with offsets, by a copy of the load's own tokenizer: a token belongs to a piece
when its characters overlap the piece's span, special tokens and the prompt to none. Pooling and what follows it
(Normalize) run here, in float32 numpy, on the states the model handed over.

A model that cannot is refused with the reason, before any work: one whose pass gives no token states (a ColBERT
projection, a SPLADE head, a reranker), one whose pooling is not a function of a span's tokens alone (``cls`` and
``lasttoken`` take one token that saw the whole window; ``weightedmean`` weighs tokens by their position in the
input), or one with Dense layers after pooling (they run inside the model's own pooled path, not on these states).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer

from inferd.core.chunking import Piece, backend
from inferd.core.description import ModelDescription
from inferd.core.errors import EngineError, Kind
from inferd.core.outcomes import TaskResult, merged_timings
from inferd.core.outputs import TextOutputs
from inferd.core.tasks.embedding_task import DEFAULT_OUTPUTS, TOKEN_STATES
from inferd.core.tasks.piece_merge import pooled_dense

# The poolings a piece's vector can be computed by from the states of its own tokens (sentence-transformers' names).
SPAN_POOLERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": lambda s: s.mean(axis=0),
    "max": lambda s: s.max(axis=0),
    "mean_sqrt_len_tokens": lambda s: s.sum(axis=0) / np.sqrt(len(s)),
}
_WHY_NOT = {"cls": "takes the first token, which saw the whole window, not a piece's span",
            "lasttoken": "takes the last token, which saw the whole window, not a piece's span",
            "weightedmean": "weighs tokens by their position in the input, which a piece inside a window does not keep"}


def refusal(description: ModelDescription, outputs: tuple[str, ...] = DEFAULT_OUTPUTS) -> EngineError | None:
    """Why the load ``description`` describes cannot late-chunk (None: it can); ``outputs``: those asked (a piece's
    dense vector is what late chunking pools)."""
    name = description.name
    if tuple(outputs) != DEFAULT_OUTPUTS:
        return _refused(f"late chunking answers each piece's dense vector; {', '.join(outputs)} was asked")
    gives = description.outputs or []
    if TOKEN_STATES.name not in gives:
        why = (f"its forward pass gives no token states to pool per piece (it gives {', '.join(gives)})" if gives
               else f"it is a {description.task} model, not an embedder")
        return _refused(f"model {name!r} cannot late-chunk: {why}")
    modes = (description.pooling or "mean").split("+")
    wrong = [m for m in modes if m not in SPAN_POOLERS]
    if wrong:
        why = _WHY_NOT.get(wrong[0], "is not a pooling of a span's tokens")
        return _refused(f"model {name!r} cannot late-chunk: its pooling {wrong[0]!r} {why}; late chunking pools "
                        f"each piece's tokens ({', '.join(SPAN_POOLERS)})")
    if description.facts.get("dense"):
        return _refused(f"model {name!r} cannot late-chunk: its Dense layers after pooling run inside the model, "
                        "not on the token states a piece is pooled from")
    return None


def _refused(message: str) -> EngineError:
    return EngineError(Kind.INVALID_INPUT, message, "late_chunking_unsupported", field="chunking.mode")


@dataclass(frozen=True)
class Window:
    """Pieces ``first``..``last`` (inclusive) of a document, run as one input: ``text[start:end]``."""

    first: int
    last: int
    start: int
    end: int


# Tokenizers copied from a load's, offsets and special tokens on, truncation off (the load's own cuts to its
# window, which would hide a window that does not fit); kept per tokenizer object, as core/chunking.py keeps its.
_copies: dict[int, tuple[Any, Tokenizer]] = {}
_lock = threading.Lock()


def untruncated(tokenizer: Any) -> Tokenizer:
    """A copy of a load's tokenizer that counts a whole text (special tokens and offsets on, no truncation)."""
    with _lock:
        hit = _copies.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    copy = Tokenizer.from_str(backend(tokenizer).to_str())
    copy.no_truncation()
    copy.no_padding()
    with _lock:
        if len(_copies) >= 16:
            _copies.clear()
        _copies[id(tokenizer)] = (tokenizer, copy)
    return copy


def windows(text: str, pieces: Sequence[Piece], tokenizer: Any, prompt: str, window: int) -> list[Window]:
    """The document's pieces grouped, in order, into windows whose input (the prompt, the window's text, the
    special tokens) is at most ``window`` tokens: each as long as it can be, each piece in exactly one."""
    tok = untruncated(tokenizer)
    doc = tok.encode(text, add_special_tokens=False)
    starts = [o[0] for o in doc.offsets]
    ends = [o[1] for o in doc.offsets]

    def estimate(a: int, b: int) -> int:  # the document's tokens inside text[a:b]
        return bisect.bisect_right(ends, b) - bisect.bisect_left(starts, a)

    extra = len(tok.encode(prompt).ids)  # the prompt's tokens and the special tokens around any input
    out: list[Window] = []
    i = 0
    while i < len(pieces):
        j = i
        while j + 1 < len(pieces) and estimate(pieces[i].start, pieces[j + 1].end) + extra <= window:
            j += 1
        # The estimate counts the document's tokens; the window's own tokenising may differ at its edges.
        while j > i and len(tok.encode(prompt + text[pieces[i].start:pieces[j].end]).ids) > window:
            j -= 1
        out.append(Window(i, j, pieces[i].start, pieces[j].end))
        i = j + 1
    return out


def piece_vectors(states: np.ndarray, encoding: Encoding, spans: Sequence[tuple[int, int]], modes: Sequence[str],
                  normalize: bool) -> list[np.ndarray]:
    """Each span's vector (``spans``: character ranges in the encoded input) from the input's token ``states``
    ``[tokens, hidden]``: the states of the tokens whose characters overlap the span, specials left out, pooled
    by each of ``modes`` side by side, normalised when the model's vectors are unit length."""
    if len(states) != len(encoding.ids):
        raise EngineError(Kind.FAILED, f"the model gave {len(states)} token states for a window of "
                          f"{len(encoding.ids)} tokens", "late_chunking_mismatch")
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    real = np.asarray(encoding.special_tokens_mask, dtype=bool) == 0
    out = []
    for a, b in spans:
        inside = real & (offsets[:, 0] < b) & (offsets[:, 1] > a)
        # A span of no token of its own: the window's; a window of no token but its specials (a text of zero-width
        # characters, which tokenise to nothing), its specials: never the mean of nothing, a vector of NaN.
        chosen = states[inside] if inside.any() else states[real] if real.any() else states
        vector = np.concatenate([SPAN_POOLERS[m](chosen.astype(np.float32)) for m in modes]).astype(np.float32)
        if normalize:
            norm = float(np.linalg.norm(vector))
            vector = vector / norm if norm > 0 else vector
        out.append(vector)
    return out


@dataclass(frozen=True)
class Late:
    """One request's late chunking: each document's text, pieces and windows, on the load that runs them."""

    texts: list[str]
    pieces: list[list[Piece]]
    plans: list[list[Window]]
    prompt: str
    tokenizer: Any

    @property
    def inputs(self) -> list[tuple[int, str]]:
        """(document, window text) for every window, in order."""
        return [(d, text[w.start:w.end]) for d, (text, plan) in enumerate(zip(self.texts, self.plans, strict=True))
                for w in plan]

    def answers(self, states: Sequence[Any], description: ModelDescription) -> list[tuple[list[np.ndarray], Any]]:
        """Each document's pieces' vectors and its pooled vector, from its windows' token states (in order)."""
        tok = untruncated(self.tokenizer)
        modes = (description.pooling or "mean").split("+")
        unit = bool(description.normalize)
        shift = len(self.prompt)
        out = []
        at = 0
        for text, found, plan in zip(self.texts, self.pieces, self.plans, strict=True):
            vectors: list[np.ndarray] = []
            for w in plan:
                encoding = tok.encode(self.prompt + text[w.start:w.end])
                value = states[at]
                value = value.token_states if isinstance(value, TextOutputs) else value
                spans = [(p.start - w.start + shift, p.end - w.start + shift) for p in found[w.first:w.last + 1]]
                vectors.extend(piece_vectors(np.asarray(value), encoding, spans, modes, unit))
                at += 1
            out.append((vectors, pooled_dense(vectors, [p.tokens for p in found], unit)))
        return out


def plan(texts: list[str], pieces: list[list[Piece]], tokenizer: Any, prompt: str, window: int) -> Late:
    return Late(texts, pieces, [windows(t, p, tokenizer, prompt, window) for t, p in zip(texts, pieces, strict=True)],
                prompt, tokenizer)


def wave_size(window: int, max_token_vectors: int, wave: int) -> int:
    """Windows per admission call: their token states together within ``limits.max_multivector_tokens``."""
    return max(1, min(wave, max_token_vectors // max(window, 1)))


def merged(late: Late, results: list[TaskResult], description: ModelDescription,
           make: Callable[[list[Piece], list[Any], Any], Any]) -> TaskResult:
    """The request's result: each document's answer ``make(pieces, piece vectors, pooled)``, its tokens those its
    windows ran."""
    states = [o for r in results for o in r.outputs]
    tokens = [n for r in results for n in r.tokens]
    answers, counts, at = [], [], 0
    for found, plan_, (vectors, pooled) in zip(late.pieces, late.plans, late.answers(states, description),
                                               strict=True):
        answers.append(make(found, vectors, pooled))
        counts.append(sum(tokens[at:at + len(plan_)]))
        at += len(plan_)
    timings = merged_timings(results)
    return TaskResult(answers, counts, description, timings, results[0].calibration)

