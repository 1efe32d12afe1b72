"""The accuracy gate: how far a converted model's outputs are from torch fp32's, and whether that is enough.

The task's own outputs are compared (for embeddings: pooled and normalised), text by text, on a
multilingual calibration set, at several batch shapes: each text alone, sorted batches of 32, shuffled
batches of 32 (mixed lengths), and small batches padded to the model's length limit. Figures:
cosine min and mean to torch (the worst shape's), top-10 neighbour overlap (retrieval agreement: of each
text's ten nearest texts under torch, how many the converted model also ranks in its ten), and the
model's own batch invariance (cosine between a text alone and the same text in padded batches).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from inferd.core.backends.base import BackendError, GateThresholds, Runner
from inferd.core.preprocess import Encoded, InputError

BUILTIN_SEED = 11_2024  # the gate's texts
CALIBRATION_SEED = 11_2025  # int8 calibration's texts: not the ones the gate judges
AT_LIMIT_SHARE = 16  # one text in this many is at the model's length limit
OVERLAP_K = 10
_FIGURE_NAMES = {"cosine_min": "cosine min", "cosine_mean": "cosine mean", "overlap_at_10": "overlap@10"}


class Probe(Protocol):
    """What the gate needs from a task: tokenise, collate, and the task's outputs for a forward pass."""

    max_seq_length: int

    def preprocess(self, texts: list[str]) -> list[Encoded]: ...
    def collate(self, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor]: ...
    def run(self, runner: Runner, batch: list[Encoded]) -> np.ndarray: ...


@dataclass(frozen=True)
class GateFigures:
    cosine_min: float
    cosine_mean: float
    overlap_at_10: float | None
    invariance_min: float
    texts: int
    shapes: dict[str, dict[str, float | None]]

    def summary(self) -> str:
        overlap = "–" if self.overlap_at_10 is None else f"{self.overlap_at_10:.4f}"
        return (f"cosine min {self.cosine_min:.6f}, mean {self.cosine_mean:.6f}, overlap@10 {overlap}, "
                f"batch invariance min {self.invariance_min:.6f} ({self.texts} texts, shapes "
                f"{', '.join(self.shapes)})")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateFigures:
        return cls(**data)


# -- the texts --------------------------------------------------------------------------------------------


def builtin_texts(count: int, seed: int = BUILTIN_SEED) -> list[str]:
    """English, Chinese and mixed texts of varied length (the benchmark's generator, another seed)."""
    from inferd.bench.corpus import texts

    return texts(count, seed)


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


def at_limit(probe: Probe, texts: Sequence[str], start: int = 0) -> Encoded:
    """A long document that fills the model's length limit (truncated, or cut to fit): the texts from
    ``start`` on, joined. Distinct texts, not one text repeated: a phrase repeated a hundred times is an
    input no encoder was trained on, and its output says little about a long passage's."""
    parts: list[str] = []
    size = 0
    # 12 characters per token is more than any English word-piece takes, so the limit is always reached.
    while size < 12 * probe.max_seq_length and len(parts) < 4 * len(texts):
        parts.append(texts[(start + len(parts)) % len(texts)])
        size += len(parts[-1]) + 1
    long = " ".join(parts)
    try:
        return probe.preprocess([long])[0]
    except InputError:
        pass  # truncation is off: find the longest prefix that fits
    lo, hi = 1, len(long)
    best: Encoded | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best, lo = probe.preprocess([long[:mid]])[0], mid + 1
        except InputError:
            hi = mid - 1
    if best is None:
        raise BackendError("the gate could not build a text at the model's length limit")
    return best


def encode_set(probe: Probe, texts: Sequence[str]) -> list[Encoded]:
    """The texts, tokenised; every AT_LIMIT_SHARE-th one replaced by a long document at the length limit."""
    out = []
    for i, text in enumerate(texts):
        if i % AT_LIMIT_SHARE == AT_LIMIT_SHARE - 1:
            out.append(at_limit(probe, texts, i))
        else:
            try:
                out.append(probe.preprocess([text])[0])
            except InputError:
                out.append(at_limit(probe, texts, i))
    return out


def calibration_samples(probe: Probe, encoded: Sequence[Encoded]) -> list[dict[str, Any]]:
    """One graph input per text (no padding: padded rows would widen the measured activation ranges)."""
    out = []
    for e in encoded:
        ids, mask = probe.collate([e])
        out.append({"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                    "token_type_ids": np.zeros_like(ids.numpy())})
    return out


def only_inputs(samples: list[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    return [{n: s[n] for n in names} for s in samples]


# -- the figures ------------------------------------------------------------------------------------------


def plans(seed: int) -> dict[str, Callable[[list[Encoded]], list[list[int]]]]:
    """Batch plans: name -> function of the items giving lists of indices (a padding row is -1)."""

    def alone(items: list[Encoded]) -> list[list[int]]:
        return [[i] for i in range(len(items))]

    def sorted32(items: list[Encoded]) -> list[list[int]]:
        order = sorted(range(len(items)), key=lambda i: items[i].tokens)
        return [order[k:k + 32] for k in range(0, len(order), 32)]

    def mixed32(items: list[Encoded]) -> list[list[int]]:
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        return [order[k:k + 32] for k in range(0, len(order), 32)]

    def padded(items: list[Encoded]) -> list[list[int]]:
        # Seven texts and one at the limit: every row of the batch is padded to the limit.
        return [[*range(k, min(k + 7, len(items))), -1] for k in range(0, len(items), 7)]

    return {"1": alone, "32 sorted": sorted32, "32 mixed": mixed32, "padded to the limit": padded}


def outputs(probe: Probe, runner: Runner, items: list[Encoded], plan: list[list[int]],
            filler: Encoded) -> np.ndarray:
    rows: list[np.ndarray | None] = [None] * len(items)
    for batch in plan:
        out = probe.run(runner, [items[i] if i >= 0 else filler for i in batch])
        for i, row in zip(batch, out, strict=True):
            if i >= 0:
                rows[i] = row
    return np.stack(rows).astype(np.float64)  # type: ignore[arg-type]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na = a / np.clip(np.linalg.norm(a, axis=1, keepdims=True), 1e-12, None)
    nb = b / np.clip(np.linalg.norm(b, axis=1, keepdims=True), 1e-12, None)
    return (na * nb).sum(axis=1)


def overlap_at_k(reference: np.ndarray, candidate: np.ndarray, k: int = OVERLAP_K) -> float:
    """Mean share of each text's k nearest neighbours (itself excluded) that both models agree on."""

    def neighbours(v: np.ndarray) -> np.ndarray:
        n = v / np.clip(np.linalg.norm(v, axis=1, keepdims=True), 1e-12, None)
        sim = n @ n.T
        np.fill_diagonal(sim, -np.inf)
        return np.argsort(-sim, axis=1, kind="stable")[:, :k]

    ref, cand = neighbours(reference), neighbours(candidate)
    return float(np.mean([len(set(r) & set(c)) / k for r, c in zip(ref, cand, strict=True)]))


def measure(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
            seed: int = BUILTIN_SEED) -> GateFigures:
    """Compare the candidate's outputs with the reference's at every batch shape."""
    items = encode_set(probe, texts)
    filler = at_limit(probe, texts)
    batch_plans = plans(seed)
    ref = outputs(probe, reference, items, batch_plans["32 sorted"](items), filler)
    ranked = ref.ndim == 2 and ref.shape[1] > 1 and len(items) > OVERLAP_K
    shapes: dict[str, dict[str, float | None]] = {}
    per_shape: dict[str, np.ndarray] = {}
    for name, plan in batch_plans.items():
        got = outputs(probe, candidate, items, plan(items), filler)
        per_shape[name] = got
        cos = cosines(ref, got)
        shapes[name] = {"cosine_min": round(float(cos.min()), 7), "cosine_mean": round(float(cos.mean()), 7),
                        "overlap_at_10": round(overlap_at_k(ref, got), 4) if ranked else None}
    alone = per_shape["1"]
    invariance = min(float(cosines(alone, v).min()) for name, v in per_shape.items() if name != "1")
    overlaps = [s["overlap_at_10"] for s in shapes.values() if s["overlap_at_10"] is not None]
    return GateFigures(
        cosine_min=min(s["cosine_min"] for s in shapes.values()),  # type: ignore[type-var]
        cosine_mean=min(s["cosine_mean"] for s in shapes.values()),  # type: ignore[type-var]
        overlap_at_10=min(overlaps) if overlaps else None, invariance_min=round(invariance, 7),
        texts=len(items), shapes=shapes)


# -- the verdict ------------------------------------------------------------------------------------------


def rules(kind: str, t: GateThresholds) -> list[tuple[str, str, float]]:
    """(figure, setting, least value) for a gate kind."""
    if kind == "int8":
        return [("cosine_min", "int8_cosine_min", t.int8_cosine_min),
                ("cosine_mean", "int8_cosine_mean", t.int8_cosine_mean),
                ("overlap_at_10", "int8_overlap_at_10", t.int8_overlap_at_10)]
    if kind == "half":
        return [("cosine_min", "half_cosine_min", t.half_cosine_min)]
    return [("cosine_min", "fp32_cosine_min", t.fp32_cosine_min)]


def judge(figures: GateFigures, kind: str, thresholds: GateThresholds) -> list[str]:
    """Every figure below its threshold, worded for an operator; empty when the model passes."""
    failures = []
    for figure, setting, least in rules(kind, thresholds):
        value = getattr(figures, figure)
        if value is not None and value < least:
            failures.append(f"{_FIGURE_NAMES[figure]} {value:.6f} < {least} (model.gate.{setting})")
    return failures
