"""The accuracy gate: how far a converted model's outputs are from torch fp32's, and whether that is enough.

The task's own outputs are compared, input by input, on a multilingual set, at several batch shapes: each
input alone, sorted batches of 32, shuffled batches of 32 (mixed lengths), and small batches padded to a long
document. The worst shape's figure counts.

What it promises for an embedding model: every input is judged alone and in sorted batches (its own rounding at
its own length: the cosine min and mean are every input's, the top-10 overlap ranks the whole set); the costly
shapes, mixed and padded batches, where every row runs at a long document's length, run on every fourth input,
every long document among them (``COSTLY``): what they add is what padding beside a longer input does to a text,
which any text shows, and a wrong mask shows on every one. They were 78% of a candidate's padded tokens on
MiniLM (the built-in 256 texts), 82% on all-mpnet-base-v2; on a quarter of the texts a candidate runs 42% and 39% of
them (180,410 -> 75,386 and 252,730 -> 99,194 padded tokens), less still in time (their rows are the long ones,
whose attention grows with the square of the length).

What the gate runs costs what its own texts cost, never the model's maximum length: its long documents are the
model's limit or ``LONG_TOKENS``, whichever is shorter, and every batch is padded to its own longest input. An
8,192-position model is judged on the same token counts as a 512-position one. Before, every padded batch ran at
8,192 tokens: a tiny random ModernBERT with 8,192 positions on OpenVINO fp32 (256 texts) was stopped unready at
10 GB after 78 s; now it loads in 47 s at 0.9 GB peak, its gate 532,727 padded tokens, its longest batch 962 (a
built-in text), on two shared cores. What it ran is counted (the figures' ``ran``).

The gate can fail: an output that is not finite (NaN, infinity), in any batch shape, fails it, and so does a
figure that is NaN (a NaN compared with a bound is no pass). A refusal says whether the graph computes something
else than torch (a wrong mask, a wrong export: any float32 failure, a non-finite output, or a figure below what
any rounding gives) or is merely less precise than the bound (``cause``). The summary prints the figures the
rules judge, each with its bound, and no other.

- Embeddings (pooled and normalised), on texts: cosine min and mean to torch, top-10 neighbour overlap
  (retrieval agreement: of each text's ten nearest texts under torch, how many the converted model also
  ranks in its ten), and the model's own batch invariance (cosine between a text alone and in batches).
- Rerank scores, on query/document pairs (each query with 16 documents, one of which it was cut from):
  the Spearman correlation of each query's document scores with torch's (mean over queries), top-3
  agreement (the share of torch's three best documents the candidate also ranks in its three), and the
  largest score difference as a share of torch's score range over the set (a logit's scale is the model's).
- Classification, on texts: the share of texts given torch's label (for multi-label models, of label
  decisions at 0.5), and the largest probability difference.
- An embedding model of other outputs (SPLADE, bge-m3, ColBERT: the task's ``outputs``) is judged on each: its dense
  vector as above; its sparse vectors by the share of each text's ten heaviest terms both agree on (the worst
  text's) and the largest weight difference as a share of the text's largest weight; its token vectors by each
  text's MaxSim ranking of the other texts (Spearman and top-3, means over texts). Without a dense vector the
  cosine figures are those of the sparse vectors over the vocabulary, or else of the token vectors.

What differs between tasks (the inputs made of the texts, the scores compared, their figures and bounds) is the
task object's (core/tasks/: ``*_task.py``); this module runs the batch shapes and judges.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from inferd.core.agreement import (
    Bound,
    cosine_rows,
    overlap_at_k,
)
from inferd.core.agreement import judge as judge_figures
from inferd.core.backends.base import BackendError, Runner
from inferd.core.preprocess import Encoded, InputError
from inferd.core.tasks.embedding_task import DEFAULT_OUTPUTS
from inferd.core.tasks.kinds import outputs_given, outputs_measured, task_of
from inferd.settings import GateSettings

BUILTIN_SEED = 11_2024  # the gate's texts
CALIBRATION_SEED = 11_2025  # int8 calibration's texts: not the ones the gate judges
AT_LIMIT_SHARE = 16  # one text in this many is at the model's length limit
OVERLAP_K = 10
# The gate's long documents: the model's limit, at most this. The BERT family's position tables end here, and a
# graph's positions past it run the same operations as those before it; beyond it the gate's cost would grow
# with the card's maximum (quadratically in attention) and say nothing more about the export.
LONG_TOKENS = 512
# Figures no rounding reaches (reduced precision's worst measured: one MiniLM text at cosine 0.66, static int8 with
# bf16 parts on a Xeon with AMX): below them a graph is told apart as a wrong one, whatever its precision.
WRONG_BELOW = {"cosine_min": 0.5, "spearman_mean": 0.5, "label_agreement": 0.5}
_FIGURE_NAMES = {"cosine_min": "cosine min", "cosine_mean": "cosine mean", "overlap_at_10": "overlap@10",
                 "spearman_mean": "Spearman mean", "top3_agreement": "top-3 agreement",
                 "label_agreement": "label agreement", "score_diff_max": "max diff",
                 "sparse_top10": "sparse top-10 term agreement", "weight_diff_max": "sparse weight diff",
                 "maxsim_spearman": "MaxSim Spearman mean", "maxsim_top3": "MaxSim top-3 agreement"}
WRONG_GRAPH = "wrong graph"
LESS_PRECISE = "less precise than the bound"


class Probe(Protocol):
    """What the gate needs from a task: tokenise its inputs (texts, or (query, document) pairs for rerank),
    collate, and the task's outputs for a forward pass (vectors, [score, raw] rows, probabilities)."""

    task: str
    max_seq_length: int
    multi_label: bool  # a classifier's labels each through a sigmoid
    outputs: tuple[str, ...]  # an embedding model's outputs (core/outputs.py)

    def preprocess(self, inputs: list[Any]) -> list[Encoded]: ...
    def collate(self, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...
    def run(self, runner: Runner, batch: list[Encoded]) -> np.ndarray: ...
    def run_outputs(self, runner: Runner, batch: list[Encoded]) -> dict[str, list[Any]]: ...
    def head_module(self, model: torch.nn.Module) -> torch.nn.Module | None: ...


def known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The stored figures the class holds: an entry written by another build of the same format may hold more."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class GateFigures:
    cosine_min: float
    cosine_mean: float
    overlap_at_10: float | None
    invariance_min: float
    texts: int
    shapes: dict[str, dict[str, float | None]]
    # Outputs that were not finite, over every batch shape (a failure whatever the thresholds).
    nonfinite: int = 0
    # What the gate ran, reference and candidate together (Tally.as_dict: batches, padded tokens, the longest
    # batch's length): counts, not figures, so apart from them.
    ran: dict[str, int] = field(default_factory=dict)
    # Sparse and token-vector outputs' figures (None: the model has no such output).
    sparse_top10: float | None = None
    weight_diff_max: float | None = None
    maxsim_spearman: float | None = None
    maxsim_top3: float | None = None

    task = "embedding"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateFigures:
        return cls(**known(cls, data))


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
    nonfinite: int = 0
    ran: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScoreFigures:
        return cls(**known(cls, data))


Figures = GateFigures | ScoreFigures


@dataclass
class Tally:
    """What the gate ran: batches, padded tokens (rows x the batch's longest input) and the longest batch."""

    batches: int = 0
    padded_tokens: int = 0
    longest: int = 0

    def add(self, batch: list[Encoded]) -> None:
        longest = max(e.tokens for e in batch)
        self.batches += 1
        self.padded_tokens += longest * len(batch)
        self.longest = max(self.longest, longest)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


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


def long_length(probe: Probe) -> int:
    """The gate's long documents' length in tokens: the model's limit, at most LONG_TOKENS."""
    return min(probe.max_seq_length, LONG_TOKENS)


def at_limit(probe: Probe, texts: Sequence[str], start: int = 0, query: str | None = None) -> Encoded:
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


def encode_set(probe: Probe, texts: Sequence[str]) -> list[Encoded]:
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


def filler_for(probe: Probe, texts: Sequence[str]) -> Encoded:
    """The long input that pads the gate's padded batches."""
    return at_limit(probe, texts, 0, task_of(probe.task).gate_query)


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
        # Seven texts and one long document: every row of the batch is padded to the long one.
        return [[*range(k, min(k + 7, len(items))), -1] for k in range(0, len(items), 7)]

    return {"1": alone, "32 sorted": sorted32, "32 mixed": mixed32, PADDED: padded}


PADDED = "padded to a long text"


# The costly shapes (a mixed batch of 32 holds a long document about every other batch, and a padded one always:
# every row runs at the long length) run on every SUBSET_STEP-th input, the long documents among them
# (AT_LIMIT_SHARE is a multiple): what they add to the cheap shapes is what padding beside a longer input does to a
# text, which any text shows. The cheap shapes (alone, sorted batches of 32) judge every input at its own length.
COSTLY = ("32 mixed", "padded to a long text")
SUBSET_STEP = 4


def subset(count: int, name: str) -> list[int]:
    """The inputs a batch shape runs on: all of them, or for a costly shape every SUBSET_STEP-th (see COSTLY)."""
    return list(range(SUBSET_STEP - 1, count, SUBSET_STEP)) if name in COSTLY else list(range(count))


def on(covered: list[int], plan: Callable[[list[Encoded]], list[list[int]]],
       items: list[Encoded]) -> list[list[int]]:
    """A batch plan made over ``covered`` inputs only, in the full set's indices (padding rows stay -1)."""
    return [[covered[j] if j >= 0 else -1 for j in batch] for batch in plan([items[i] for i in covered])]


def outputs(probe: Probe, runner: Runner, items: list[Encoded], plan: list[list[int]],
            filler: Encoded, tally: Tally | None = None, covered: list[int] | None = None) -> np.ndarray:
    """The rows of the inputs ``covered`` (all, by default), in that order, computed in the plan's batches."""
    rows: list[np.ndarray | None] = [None] * len(items)
    for batch in plan:
        inputs = [items[i] if i >= 0 else filler for i in batch]
        if tally is not None:
            tally.add(inputs)
        out = probe.run(runner, inputs)
        for i, row in zip(batch, out, strict=True):
            if i >= 0:
                rows[i] = row
    return np.stack([rows[i] for i in (range(len(items)) if covered is None else covered)]  # type: ignore[misc]
                    ).astype(np.float64)


def measure(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
            seed: int = BUILTIN_SEED) -> Figures:
    """Compare the candidate's outputs with the reference's at every batch shape: as vectors (each of an embedding
    model's outputs, when it gives more than a dense vector) or as the task's scores."""
    if not task_of(probe.task).gate_vectors:
        return measure_scores(probe, reference, candidate, texts, seed)
    if tuple(probe.outputs) != DEFAULT_OUTPUTS:
        return measure_outputs(probe, reference, candidate, texts, seed)
    return measure_embeddings(probe, reference, candidate, texts, seed)


def nonfinite_rows(values: np.ndarray) -> int:
    """How many outputs (rows) hold a NaN or an infinity."""
    return int((~np.isfinite(values.reshape(len(values), -1))).any(axis=1).sum())


def worst(values: Sequence[float | None], upper: bool = False) -> float | None:
    """The worst of a figure over the shapes; NaN if any shape's is (Python's min would keep or drop a NaN by
    its place in the list)."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    if any(np.isnan(v) for v in present):
        return float("nan")
    return max(present) if upper else min(present)


def reference_outputs(probe: Probe, reference: Runner, items: list[Encoded], plan: list[list[int]],
                      filler: Encoded, tally: Tally) -> np.ndarray:
    ref = outputs(probe, reference, items, plan, filler, tally)
    if bad := nonfinite_rows(ref):
        raise BackendError(f"torch fp32 itself answers NaN or infinity for {bad} of the gate's {len(ref)} inputs: "
                           "the model (its weights or config.json), not a conversion, is what is wrong")
    return ref


def measure_scores(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
                   seed: int = BUILTIN_SEED) -> ScoreFigures:
    """A task's scores (the task's ``gate_scores``: a reranker's score column, a classifier's probabilities),
    compared by the task's ``gate_figures``."""
    task = task_of(probe.task)
    items = encode_set(probe, texts)
    filler = filler_for(probe, texts)
    batch_plans = plans(seed)
    multi_label = probe.multi_label
    tally = Tally()

    def task_outputs(runner: Runner, plan: list[list[int]]) -> np.ndarray:
        return task.gate_scores(outputs(probe, runner, items, plan, filler, tally))

    ref = task.gate_scores(reference_outputs(probe, reference, items, batch_plans["32 sorted"](items), filler, tally))
    shapes: dict[str, dict[str, float | None]] = {}
    per_shape: dict[str, np.ndarray] = {}
    nonfinite = 0
    for name, plan in batch_plans.items():
        got = task_outputs(candidate, plan(items))
        per_shape[name] = got
        bad = nonfinite_rows(got)
        nonfinite += bad
        figures = task.gate_figures(ref, got, multi_label)
        # Figures over NaN outputs are meaningless (a rank of NaN is arbitrary): NaN, which fails.
        shapes[name] = {**{k: float("nan") if bad else v for k, v in figures.items()}, "nonfinite": bad}
    alone = per_shape["1"]
    span = task.gate_span(ref)
    invariance = worst([float(np.abs(alone - v).max()) / span for name, v in per_shape.items() if name != "1"],
                       upper=True)

    def figure(name: str, upper: bool = False) -> float | None:
        return worst([v[name] for v in shapes.values() if name in v], upper)

    return ScoreFigures(task=probe.task, spearman_mean=figure("spearman_mean"), top3_agreement=figure("top3_agreement"),
                        label_agreement=figure("label_agreement"),
                        score_diff_max=figure("score_diff_max", upper=True) or 0.0,
                        invariance_diff_max=round(invariance or 0.0, 7), texts=len(items), shapes=shapes,
                        nonfinite=nonfinite, ran=tally.as_dict())


def measure_embeddings(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
                       seed: int = BUILTIN_SEED) -> GateFigures:
    """Cosine, overlap and invariance of pooled vectors at every batch shape."""
    items = encode_set(probe, texts)
    filler = filler_for(probe, texts)
    batch_plans = plans(seed)
    tally = Tally()
    ref = reference_outputs(probe, reference, items, batch_plans["32 sorted"](items), filler, tally)
    ranked = ref.ndim == 2 and ref.shape[1] > 1 and len(items) > OVERLAP_K
    shapes: dict[str, dict[str, float | None]] = {}
    per_shape: dict[str, np.ndarray] = {}
    nonfinite = 0
    covers: dict[str, list[int]] = {}
    for name, plan in batch_plans.items():
        covered = covers[name] = subset(len(items), name)
        got = outputs(probe, candidate, items, on(covered, plan, items), filler, tally, covered)
        per_shape[name] = got
        bad = nonfinite_rows(got)
        nonfinite += bad
        cos = cosine_rows(ref[covered], got)
        nan = float("nan")
        # Neighbours are ranked within the whole set only: a subset's ten nearest are another question.
        whole = len(covered) == len(items)
        shapes[name] = {"cosine_min": nan if bad else round(float(cos.min()), 7),
                        "cosine_mean": nan if bad else round(float(cos.mean()), 7),
                        "overlap_at_10": ((nan if bad else round(overlap_at_k(ref, got, OVERLAP_K), 4))
                                          if ranked and whole else None),
                        "nonfinite": bad}
    alone = per_shape["1"]  # every input: its rows of any subset are its indices
    invariance = worst([float(np.min(cosine_rows(alone[covers[name]], v)))
                        for name, v in per_shape.items() if name != "1"])

    def figure(name: str) -> float | None:
        return worst([s[name] for s in shapes.values()])

    return GateFigures(
        cosine_min=figure("cosine_min"), cosine_mean=figure("cosine_mean"),  # type: ignore[arg-type]
        overlap_at_10=figure("overlap_at_10"), invariance_min=round(invariance, 7),  # type: ignore[arg-type]
        texts=len(items), shapes=shapes, nonfinite=nonfinite, ran=tally.as_dict())


def outputs_of(probe: Probe, runner: Runner, items: list[Encoded], plan: list[list[int]], filler: Encoded,
               tally: Tally) -> dict[str, list[Any]]:
    """Each output's value per input (``run_outputs``), over a batch plan."""
    rows: dict[str, list[Any]] = {}
    for batch in plan:
        inputs = [items[i] if i >= 0 else filler for i in batch]
        tally.add(inputs)
        for kind, values in probe.run_outputs(runner, inputs).items():
            got = rows.setdefault(kind, [None] * len(items))
            for i, value in zip(batch, values, strict=True):
                if i >= 0:
                    got[i] = value
    return rows


def _finite(value: Any) -> bool:
    parts = value if isinstance(value, tuple) else (value,)
    return all(bool(np.isfinite(np.asarray(p, dtype=np.float64)).all()) for p in parts)


def output_figures(ref: dict[str, list[Any]], got: dict[str, list[Any]], ranked: bool) -> dict[str, float | None]:
    """One batch shape's figures, every output of the model's (see the module's docstring): the cosine figures
    of its first output (the dense vector's, else the sparse vectors' or the token vectors'), and each output's
    own (core/tasks/embedding_task.py)."""
    given = outputs_given(ref)
    cos = given[0].cosines(ref[given[0].name], got[given[0].name])
    out: dict[str, float | None] = {"overlap_at_10": None}
    out["cosine_min"], out["cosine_mean"] = round(float(cos.min()), 7), round(float(cos.mean()), 7)
    for output in given:
        out.update(output.figures(ref[output.name], got[output.name], ranked))
    return out


def measure_outputs(probe: Probe, reference: Runner, candidate: Runner, texts: Sequence[str],
                    seed: int = BUILTIN_SEED) -> GateFigures:
    """An embedding model of several outputs: each output's figures at every batch shape, the worst counting."""
    items = encode_set(probe, texts)
    filler = filler_for(probe, texts)
    batch_plans = plans(seed)
    tally = Tally()
    ref = outputs_of(probe, reference, items, batch_plans["32 sorted"](items), filler, tally)
    bad_ref = sum(not _finite(v) for values in ref.values() for v in values)
    if bad_ref:
        raise BackendError(f"torch fp32 itself answers NaN or infinity for {bad_ref} of the gate's outputs: the "
                           "model (its weights or config.json), not a conversion, is what is wrong")
    ranked = len(items) > OVERLAP_K
    shapes: dict[str, dict[str, float | None]] = {}
    nonfinite = 0
    alone: dict[str, list[Any]] = {}
    invariance: list[float] = []
    for name, plan in batch_plans.items():
        got = outputs_of(probe, candidate, items, plan(items), filler, tally)
        bad = sum(not _finite(v) for values in got.values() for v in values)
        nonfinite += bad
        figures = output_figures(ref, got, ranked)
        # Figures over NaN outputs are meaningless: NaN, which fails.
        shapes[name] = {**{k: float("nan") if bad and v is not None else v for k, v in figures.items()},
                        "nonfinite": bad}
        if name == "1":
            alone = got
        elif not bad:
            invariance.append(float(output_figures(alone, got, False)["cosine_min"] or 0.0))

    def figure(key: str, upper: bool = False) -> float | None:
        return worst([s.get(key) for s in shapes.values()], upper)

    return GateFigures(
        cosine_min=figure("cosine_min"), cosine_mean=figure("cosine_mean"),  # type: ignore[arg-type]
        overlap_at_10=figure("overlap_at_10"), invariance_min=round(min(invariance, default=1.0), 7),
        texts=len(items), shapes=shapes, nonfinite=nonfinite, ran=tally.as_dict(),
        sparse_top10=figure("sparse_top10"), weight_diff_max=figure("weight_diff_max", upper=True),
        maxsim_spearman=figure("maxsim_spearman"), maxsim_top3=figure("maxsim_top3"))


# -- the verdict ------------------------------------------------------------------------------------------


def held_to(figures: Figures, kind: str, thresholds: GateSettings) -> list[Bound]:
    """The bounds these figures answer to: the task's, and a sparse or token-vector output's where measured."""
    out = task_of(figures.task).bounds(kind, thresholds)
    for output in outputs_measured(figures):
        out += output.bounds(kind, thresholds)
    return out


def _nonfinite_shapes(figures: Figures) -> list[str]:
    return [name for name, shape in figures.shapes.items() if shape.get("nonfinite")]


def judge(figures: Figures, kind: str, thresholds: GateSettings) -> list[str]:
    """Every figure past its bound, worded for an operator; empty when the model passes. A non-finite output
    fails whatever the thresholds."""
    failures = []
    if figures.nonfinite:
        failures.append(f"{figures.nonfinite} outputs are not finite (NaN or infinity) in batch shapes "
                        f"{', '.join(_nonfinite_shapes(figures)) or '?'}")
    # A figure the model has not (None: overlap of one-dimensional outputs) is not judged.
    failures += judge_figures(figures.as_dict(), held_to(figures, kind, thresholds), _FIGURE_NAMES)[0]
    return failures


def cause(figures: Figures, kind: str, thresholds: GateSettings) -> str | None:
    """Why a refused graph is refused: WRONG_GRAPH (it computes something else than torch) or LESS_PRECISE
    (rounding moved it past a bound), with the reason; None when it passes."""
    if not judge(figures, kind, thresholds):
        return None
    if figures.nonfinite:
        return (f"{WRONG_GRAPH}: it answers NaN or infinity where torch fp32 answers numbers (in batch shapes "
                f"{', '.join(_nonfinite_shapes(figures))}): a wrong mask or a wrong export, not rounding"
                + (" (or float16's range overflowed)" if kind == "half" else ""))
    if kind == "fp32":
        return (f"{WRONG_GRAPH}: a float32 graph computes what torch fp32 computes, so a figure past the float32 "
                "bound is another computation (a wrong mask or a wrong export), not rounding")
    far = [f"{_FIGURE_NAMES[name]} {value:.6f} < {floor}" for name, floor in WRONG_BELOW.items()
           if (value := getattr(figures, name, None)) is not None and not value >= floor]
    if far:
        return (f"{WRONG_GRAPH}: {', '.join(far)}, beyond anything reduced precision gives: a wrong mask or a wrong "
                "export")
    return (f"{LESS_PRECISE}: the graph agrees with torch fp32, {kind} rounding moved it past the bound; use "
            "float32, or loosen the model.gate setting named if the figures are good enough for its use")


def summary(figures: Figures, kind: str, thresholds: GateSettings) -> str:
    """The figures the rules judge, each with its bound (no other figure: one no rule judges reads as a pass
    whatever its value), and what they were measured on."""
    parts = [f"non-finite outputs {figures.nonfinite} (must be 0)"]
    for rule in held_to(figures, kind, thresholds):
        value = getattr(figures, rule.figure)
        if value is not None:
            parts.append(f"{_FIGURE_NAMES[rule.figure]} {value:.6f} ({'≤' if rule.upper else '≥'} {rule.bound})")
    unit = task_of(figures.task).unit
    return f"{', '.join(parts)} ({figures.texts} {unit}, shapes {', '.join(figures.shapes)})"
