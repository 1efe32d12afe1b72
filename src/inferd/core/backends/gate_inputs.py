"""What the accuracy gate runs on: its texts, the task's inputs made of them, and int8 calibration's samples.

The texts are built in (English, Chinese and mixed: the benchmark's corpus generator under the gate's own seed) or
the operator's ``model.calibration_file``, which then serves calibration too: they are what the model will see.
The task object makes its inputs of them (core/tasks/: ``gate_inputs``; rerank pairs each query with 16
documents), and one input in ``AT_LIMIT_SHARE`` is a long document at the gate's long length.

What the gate runs costs what its own texts cost, never the model's maximum length: its long documents are the
model's limit or ``LONG_TOKENS``, whichever is shorter, and every batch is padded to its own longest input
(core/backends/gate_shapes.py). An 8,192-position model is judged on the same token counts as a 512-position one,
which tests/integration/test_backends.py holds a tiny ModernBERT of 8,192 positions to: attention's cost grows
with the square of the length, so a gate padded to a long-context model's maximum would cost its start minutes
and gigabytes and say nothing more about the export.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from inferd import corpus
from inferd.core.backends.base import BackendError, Runner
from inferd.core.preprocess import Encoded, InputError
from inferd.core.tasks.kinds import task_of

BUILTIN_SEED = 11_2024  # the gate's texts
CALIBRATION_SEED = 11_2025  # int8 calibration's texts: not the ones the gate judges
AT_LIMIT_SHARE = 16  # one text in this many is at the model's length limit
# The neighbours the overlap figure counts; a set of fewer than twice as many texts ranks nothing worth judging.
OVERLAP_K = 10
# The gate's long documents: the model's limit, at most this. The BERT family's position tables end here, and a
# graph's positions past it run the same operations as those before it; beyond it the gate's cost would grow
# with the card's maximum (quadratically in attention) and say nothing more about the export.
LONG_TOKENS = 512


class GatedTask(Protocol):
    """What the gate needs from a task's handler: tokenise its inputs (texts, or (query, document) pairs for
    rerank), collate, and the task's outputs for a forward pass (vectors, [score, raw] rows, probabilities)."""

    task: str
    max_seq_length: int
    multi_label: bool  # a classifier's labels each through a sigmoid
    outputs: tuple[str, ...]  # an embedding model's outputs (core/outputs.py)

    def preprocess(self, inputs: list[Any]) -> list[Encoded]: ...
    def collate(self, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...
    def forward(self, runner: Runner, batch: list[Encoded]) -> np.ndarray: ...
    def forward_outputs(self, runner: Runner, batch: list[Encoded]) -> dict[str, list[Any]]: ...
    def head_module(self, model: torch.nn.Module) -> torch.nn.Module | None: ...


# -- the texts --------------------------------------------------------------------------------------------


def builtin_texts(count: int, seed: int = BUILTIN_SEED) -> list[str]:
    """English, Chinese and mixed texts of varied length (the benchmark's generator, another seed)."""
    return corpus.texts(count, seed)


def read_calibration_file(path: Path) -> list[str]:
    """One text per line, or JSON lines with a "text" field; blank lines are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BackendError(f"model.calibration_file {path}: {exc}") from exc
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as exc:
                raise BackendError(f"model.calibration_file {path}, line {n}: not a JSON object with a "
                                   f"'text' string ({exc})") from exc
            if not isinstance(text, str) or not text.strip():
                raise BackendError(f"model.calibration_file {path}, line {n}: 'text' must be a non-empty string")
            out.append(text)
        else:
            out.append(line)
    if len(out) < 2 * OVERLAP_K:
        raise BackendError(f"model.calibration_file {path} holds {len(out)} texts; the gate needs at least "
                           f"{2 * OVERLAP_K}")
    return out


# -- the inputs made of them ------------------------------------------------------------------------------


def long_length(probe: GatedTask) -> int:
    """The gate's long documents' length in tokens: the model's limit, at most LONG_TOKENS."""
    return min(probe.max_seq_length, LONG_TOKENS)


def at_limit(probe: GatedTask, texts: Sequence[str], start: int = 0, query: str | None = None) -> Encoded:
    """A long document that fills the gate's long length (``long_length``: truncated, or cut to fit): the
    texts from ``start`` on, joined (after ``query``, for a pair). Distinct texts, not one text repeated: a
    phrase repeated a hundred times is an input no encoder was trained on, and its output says little about a
    long passage's."""
    limit = long_length(probe)
    parts: list[str] = []
    size = 0
    # 12 characters per token is more than any English word-piece takes, so the length is always reached.
    while size < 12 * limit and len(parts) < 4 * len(texts):
        parts.append(texts[(start + len(parts)) % len(texts)])
        size += len(parts[-1]) + 1
    long = " ".join(parts)

    def wrap(text: str) -> Any:
        return text if query is None else (query, text)

    def fitting(text: str) -> Encoded | None:
        try:
            encoded = probe.preprocess([wrap(text)])[0]
        except InputError:  # truncation is off
            return None
        return encoded if encoded.tokens <= limit else None

    whole = fitting(long)
    if whole is not None:
        return whole
    # Longer than the gate's length (a model whose limit is past LONG_TOKENS) or refused: the longest prefix
    # that fits.
    lo, hi = 1, len(long)
    best: Encoded | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        found = fitting(long[:mid])
        if found is not None:
            best, lo = found, mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise BackendError("the gate could not build a long text within the model's length limit")
    return best


def encode_set(probe: GatedTask, texts: Sequence[str]) -> list[Encoded]:
    """The task's gate inputs made from the texts, tokenised; every AT_LIMIT_SHARE-th one replaced by a
    long document at the length limit (for a pair: the same query with a long document)."""
    texts = list(texts)
    out = []
    for i, item in enumerate(task_of(probe.task).gate_inputs(texts)):
        query = item[0] if isinstance(item, tuple) else None
        if i % AT_LIMIT_SHARE == AT_LIMIT_SHARE - 1:
            out.append(at_limit(probe, texts, i, query))
        else:
            try:
                out.append(probe.preprocess([item])[0])
            except InputError:
                out.append(at_limit(probe, texts, i, query))
    return out


def filler_for(probe: GatedTask, texts: Sequence[str]) -> Encoded:
    """The long input that pads the gate's padded batches."""
    return at_limit(probe, texts, 0, task_of(probe.task).gate_query)


# -- int8 calibration's samples ---------------------------------------------------------------------------


def calibration_samples(probe: GatedTask, encoded: Sequence[Encoded]) -> list[dict[str, Any]]:
    """One graph input per input (no padding: padded rows would widen the measured activation ranges)."""
    out = []
    for e in encoded:
        ids, mask, types = probe.collate([e])
        out.append({"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                    "token_type_ids": (types if types is not None else torch.zeros_like(ids)).numpy()})
    return out


def only_inputs(samples: list[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    return [{n: s[n] for n in names} for s in samples]
