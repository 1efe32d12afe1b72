"""The accuracy gate: how far a converted model's outputs are from torch fp32's, and whether that is enough.

The task's own outputs are compared, input by input, on a multilingual set, at several batch shapes: each
input alone, sorted batches of 32, shuffled batches of 32 (mixed lengths), and small batches padded to the
model's length limit. The worst shape's figure counts.

- Embeddings (pooled and normalised), on texts: cosine min and mean to torch, top-10 neighbour overlap
  (retrieval agreement: of each text's ten nearest texts under torch, how many the converted model also
  ranks in its ten), and the model's own batch invariance (cosine between a text alone and in batches).
- Rerank scores, on query/document pairs (each query with 16 documents, one of which it was cut from):
  the Spearman correlation of each query's document scores with torch's (mean over queries), top-3
  agreement (the share of torch's three best documents the candidate also ranks in its three), and the
  largest score difference as a share of torch's score range over the set (a logit's scale is the model's).
- Classification, on texts: the share of texts given torch's label (for multi-label models, of label
  decisions at 0.5), and the largest probability difference.
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

from inferd.config import GateSettings
from inferd.core.agreement import spearman, top_agreement
from inferd.core.backends.base import BackendError, Runner
from inferd.core.preprocess import Encoded, InputError

BUILTIN_SEED = 11_2024  # the gate's texts
CALIBRATION_SEED = 11_2025  # int8 calibration's texts: not the ones the gate judges
AT_LIMIT_SHARE = 16  # one text in this many is at the model's length limit
OVERLAP_K = 10
PER_QUERY = 16  # documents per query in the rerank gate's set
_FIGURE_NAMES = {"cosine_min": "cosine min", "cosine_mean": "cosine mean", "overlap_at_10": "overlap@10",
                 "spearman_mean": "Spearman mean", "top3_agreement": "top-3 agreement",
                 "label_agreement": "label agreement", "score_diff_max": "max diff"}


class Probe(Protocol):
    """What the gate needs from a task: tokenise its inputs (texts, or (query, document) pairs for rerank),
    collate, and the task's outputs for a forward pass (vectors, [score, raw] rows, probabilities)."""

    task: str
    max_seq_length: int

    def preprocess(self, inputs: list[Any]) -> list[Encoded]: ...
    def collate(self, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...
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


@dataclass(frozen=True)
class ScoreFigures:
    """Rerank and classification figures (see the module's docstring); a figure the task has not is None."""

    task: str
    spearman_mean: float | None
    top3_agreement: float | None
    label_agreement: float | None
    score_diff_max: float
    invariance_diff_max: float
    texts: int
    shapes: dict[str, dict[str, float | None]]

    def summary(self) -> str:
        parts = [f"{_FIGURE_NAMES[name]} {value:.4f}" for name in ("spearman_mean", "top3_agreement",
                                                                 "label_agreement", "score_diff_max")
                 if (value := getattr(self, name)) is not None]
        unit = "pairs" if self.task == "rerank" else "texts"
        return (f"{', '.join(parts)}, batch invariance max diff {self.invariance_diff_max:.6f} ({self.texts} "
                f"{unit}, shapes {', '.join(self.shapes)})")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScoreFigures:
        return cls(**data)


Figures = GateFigures | ScoreFigures


def figures_from_dict(data: dict[str, Any]) -> Figures:
    return ScoreFigures.from_dict(data) if "task" in data else GateFigures.from_dict(data)


# -- the texts --------------------------------------------------------------------------------------------


def builtin_texts(count: int, seed: int = BUILTIN_SEED) -> list[str]:
    """English, Chinese and mixed texts of varied length (the benchmark's generator, another seed)."""
    from inferd.corpus import texts

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


def gate_inputs(task: str, texts: Sequence[str]) -> list[Any]:
    """What the gate runs a task on: the texts, or for rerank query/document pairs made from them (each
    group of PER_QUERY texts is one query's documents; the query is the start of one of them, so a query
    has one relevant document and a ranking to keep)."""
    if task != "rerank":
        return list(texts)
    pairs: list[tuple[str, str]] = []
    for g in range(len(texts) // PER_QUERY):
        docs = texts[g * PER_QUERY:(g + 1) * PER_QUERY]
        source = docs[g % PER_QUERY]
        query = " ".join(source.split()[:8]) if " " in source else source[:16]
        pairs += [(query, d) for d in docs]
    return pairs


def at_limit(probe: Probe, texts: Sequence[str], start: int = 0, query: str | None = None) -> Encoded:
    """A long document that fills the model's length limit (truncated, or cut to fit): the texts from
    ``start`` on, joined (after ``query``, for a pair). Distinct texts, not one text repeated: a phrase
    repeated a hundred times is an input no encoder was trained on, and its output says little about a long
    passage's."""
    parts: list[str] = []
    size = 0
    # 12 characters per token is more than any English word-piece takes, so the limit is always reached.
    while size < 12 * probe.max_seq_length and len(parts) < 4 * len(texts):
        parts.append(texts[(start + len(parts)) % len(texts)])
        size += len(parts[-1]) + 1
    long = " ".join(parts)

    def wrap(text: str) -> Any:
        return text if query is None else (query, text)

    try:
        return probe.preprocess([wrap(long)])[0]
    except InputError:
        pass  # truncation is off: find the longest prefix that fits
    lo, hi = 1, len(long)
    best: Encoded | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best, lo = probe.preprocess([wrap(long[:mid])])[0], mid + 1
        except InputError:
            hi = mid - 1
    if best is None:
        raise BackendError("the gate could not build a text at the model's length limit")
    return best


def encode_set(probe: Probe, texts: Sequence[str]) -> list[Encoded]:
    """The task's gate inputs made from the texts, tokenised; every AT_LIMIT_SHARE-th one replaced by a
    long document at the length limit (for a pair: the same query with a long document)."""
    texts = list(texts)
    out = []
    for i, item in enumerate(gate_inputs(probe.task, texts)):
        query = item[0] if isinstance(item, tuple) else None
        if i % AT_LIMIT_SHARE == AT_LIMIT_SHARE - 1:
            out.append(at_limit(probe, texts, i, query))
        else:
            try:
                out.append(probe.preprocess([item])[0])
            except InputError:
                out.append(at_limit(probe, texts, i, query))
    return out


def filler_for(probe: Probe, texts: Sequence[str]) -> Encoded:
    """The input at the length limit that pads the gate's padded batches."""
    return at_limit(probe, texts, 0, "what is this about" if probe.task == "rerank" else None)


def calibration_samples(probe: Probe, encoded: Sequence[Encoded]) -> list[dict[str, Any]]:
    """One graph input per input (no padding: padded rows would widen the measured activation ranges)."""
    out = []
    for e in encoded:
        ids, mask, types = probe.collate([e])
        out.append({"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                    "token_type_ids": (types if types is not None else torch.zeros_like(ids)).numpy()})
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
    """Mean share of each text's k nearest neighbours (itself excluded) that both models agree on; a repeated
    text's copies are ties, not disagreement (core/agreement.py)."""

    def similarities(v: np.ndarray) -> np.ndarray:
        n = v / np.clip(np.linalg.norm(v, axis=1, keepdims=True), 1e-12, None)
        return n @ n.T

    ref, cand = similarities(reference), similarities(candidate)
    return float(np.mean([top_agreement(np.delete(r, i), np.delete(c, i), k)
                          for i, (r, c) in enumerate(zip(ref, cand, strict=True))]))


def ranking_figures(reference: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """Rerank: per query (each PER_QUERY consecutive pairs), rank agreement with the reference; score
    difference as a share of the reference's range over the whole set."""
    groups = [slice(k, k + PER_QUERY) for k in range(0, len(reference) - PER_QUERY + 1, PER_QUERY)]
    span = float(reference.max() - reference.min()) or 1.0
    return {"spearman_mean": round(float(np.mean([spearman(reference[g], got[g]) for g in groups])), 6),
            "top3_agreement": round(float(np.mean([top_agreement(reference[g], got[g]) for g in groups])), 4),
            "score_diff_max": round(float(np.abs(reference - got).max()) / span, 7)}


def label_figures(reference: np.ndarray, got: np.ndarray, multi_label: bool) -> dict[str, float]:
    """Classification: the share of decisions that agree, and the largest probability difference."""
    if multi_label:
        agree = float(((reference >= 0.5) == (got >= 0.5)).mean())
    else:
        agree = float((reference.argmax(axis=1) == got.argmax(axis=1)).mean())
    return {"label_agreement": round(agree, 6), "score_diff_max": round(float(np.abs(reference - got).max()), 7)}


def measure(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
            seed: int = BUILTIN_SEED) -> Figures:
    """Compare the candidate's outputs with the reference's at every batch shape."""
    if probe.task == "embedding":
        return measure_embeddings(probe, reference, candidate, texts, seed)
    return measure_scores(probe, reference, candidate, texts, seed)


def measure_scores(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
                   seed: int = BUILTIN_SEED) -> ScoreFigures:
    """Rerank (the score column of the task's [score, raw] rows) or classification (the probabilities)."""
    items = encode_set(probe, texts)
    filler = filler_for(probe, texts)
    batch_plans = plans(seed)
    rerank = probe.task == "rerank"
    multi_label = bool(getattr(probe, "multi_label", False))

    def task_outputs(runner: Runner, plan: list[list[int]]) -> np.ndarray:
        out = outputs(probe, runner, items, plan, filler)
        return out[:, 0] if rerank else out

    ref = task_outputs(reference, batch_plans["32 sorted"](items))
    shapes: dict[str, dict[str, float | None]] = {}
    per_shape: dict[str, np.ndarray] = {}
    for name, plan in batch_plans.items():
        got = task_outputs(candidate, plan(items))
        per_shape[name] = got
        shapes[name] = dict(ranking_figures(ref, got) if rerank else label_figures(ref, got, multi_label))
    alone = per_shape["1"]
    span = (float(ref.max() - ref.min()) or 1.0) if rerank else 1.0
    invariance = max(float(np.abs(alone - v).max()) / span for name, v in per_shape.items() if name != "1")

    def worst(figure: str, upper: bool = False) -> float | None:
        values = [v[figure] for v in shapes.values() if v.get(figure) is not None]
        return (max(values) if upper else min(values)) if values else None  # type: ignore[type-var]

    return ScoreFigures(task=probe.task, spearman_mean=worst("spearman_mean"), top3_agreement=worst("top3_agreement"),
                        label_agreement=worst("label_agreement"),
                        score_diff_max=worst("score_diff_max", upper=True) or 0.0,
                        invariance_diff_max=round(invariance, 7), texts=len(items), shapes=shapes)


def measure_embeddings(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
                       seed: int = BUILTIN_SEED) -> GateFigures:
    """Cosine, overlap and invariance of pooled vectors at every batch shape."""
    items = encode_set(probe, texts)
    filler = filler_for(probe, texts)
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


@dataclass(frozen=True)
class Rule:
    """A figure's bound: at least ``bound`` (or at most, when ``upper``), set by ``model.gate.<setting>``."""

    figure: str
    setting: str
    bound: float
    upper: bool = False


def rules(kind: str, t: GateSettings, task: str = "embedding") -> list[Rule]:
    """The bounds for a gate kind (int8, half, fp32) and task."""
    if task == "rerank":
        return [Rule("spearman_mean", "rerank_spearman_min", t.rerank_spearman_min),
                Rule("top3_agreement", "rerank_top3_min", t.rerank_top3_min),
                Rule("score_diff_max", f"{kind}_score_diff_max", getattr(t, f"{kind}_score_diff_max"), True)]
    if task == "classification":
        return [Rule("label_agreement", "classification_agreement_min", t.classification_agreement_min),
                Rule("score_diff_max", f"{kind}_probability_diff_max", getattr(t, f"{kind}_probability_diff_max"),
                     True)]
    if kind == "int8":
        return [Rule("cosine_min", "int8_cosine_min", t.int8_cosine_min),
                Rule("cosine_mean", "int8_cosine_mean", t.int8_cosine_mean),
                Rule("overlap_at_10", "int8_overlap_at_10", t.int8_overlap_at_10)]
    if kind == "half":
        return [Rule("cosine_min", "half_cosine_min", t.half_cosine_min)]
    return [Rule("cosine_min", "fp32_cosine_min", t.fp32_cosine_min)]


def judge(figures: Figures, kind: str, thresholds: GateSettings) -> list[str]:
    """Every figure past its bound, worded for an operator; empty when the model passes."""
    failures = []
    task = figures.task if isinstance(figures, ScoreFigures) else "embedding"
    for rule in rules(kind, thresholds, task):
        value = getattr(figures, rule.figure)
        if value is None:
            continue
        if rule.upper and value > rule.bound:
            failures.append(f"{_FIGURE_NAMES[rule.figure]} {value:.6f} > {rule.bound} (model.gate.{rule.setting})")
        elif not rule.upper and value < rule.bound:
            failures.append(f"{_FIGURE_NAMES[rule.figure]} {value:.6f} < {rule.bound} (model.gate.{rule.setting})")
    return failures
