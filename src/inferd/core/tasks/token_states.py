"""The ``token_states`` output of an embedder: the last hidden state of every token the model saw, special tokens
and a prompt included, unnormalised, before pooling and any Dense layer: what text-embeddings-inference's
``/embed_all`` answers (its raw embeddings), and what a client pools per span for late chunking.

A model gives it when its runner hands the task hidden states (the ``hidden`` head, every backend: pooling stays in
the task; bge-m3's token head holds them too); a classifier's logits or a SPLADE head's vocabulary weights do not, and
a ColBERT graph keeps only its projection. ``[tokens, hidden]`` floats per text: a request's answer is held to
``limits.max_multivector_tokens`` token vectors like a multi-vector one, counted once tokenised, before it queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferd.core.outputs import asked, token_vectors_refusal
from inferd.core.preprocess import Encoded, InputError
from inferd.core.text_options import InputOptions

NAME = "token_states"


@dataclass(frozen=True, slots=True)
class WithStates(Encoded):
    """A tokenised text that asked for its token states (``dense``: its pooled vector too)."""

    dense: bool = False


def mark(options: InputOptions, encoded: list[Encoded], gives: tuple[str, ...], max_vectors: int) -> list[Encoded]:
    """The encoded texts, those whose options ask for token states marked; a text asking for an output outside
    ``gives`` is refused (the engine refuses it before any work; a direct caller of the handler is told here), and a
    request whose token states would hold more than ``max_vectors`` vectors is refused before it queues."""
    out: list[Encoded] = []
    count = 0
    for i, (chosen, enc) in enumerate(zip(options.per_text(len(encoded)), encoded, strict=True)):
        wanted = asked(chosen, ("dense",))
        missing = [k for k in wanted if k not in gives]
        if missing:
            raise InputError(i, f"asks for {', '.join(missing)}; this model gives {', '.join(gives)}",
                             "unsupported_output")
        if NAME not in wanted:
            out.append(enc)
            continue
        count += enc.tokens
        out.append(WithStates(enc.ids, enc.truncated, enc.type_ids, enc.skip, dense="dense" in wanted))
    if count > max_vectors:
        raise InputError(None, token_vectors_refusal(count, max_vectors), "too_many_token_vectors")
    return out


def asks_states(batch: Sequence[Encoded]) -> bool:
    return any(isinstance(e, WithStates) for e in batch)


def states_of(hidden: torch.Tensor, mask: torch.Tensor, row: int) -> np.ndarray:
    """One row's token states ``[tokens, hidden]`` float32: the positions it attended, wherever its padding is."""
    keep = mask[row].bool().to(hidden.device)
    return hidden[row][keep].float().cpu().numpy()
