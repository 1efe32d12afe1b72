"""The accuracy gate: how far a converted model's outputs are from torch fp32's, measured.

The task's own outputs are compared, input by input, on a multilingual set (core/backends/gate_inputs.py), at
several batch shapes (core/backends/gate_shapes.py): each input alone, sorted batches of 32, shuffled batches of 32
(mixed lengths), and small batches padded to a long document. The worst shape's figure counts; the figures are
core/backends/gate_figures.py's records, and whether they are enough is core/backends/gate_verdict.py's.

For an embedding model every input is judged alone and in sorted batches (its own rounding at its own length: the
cosine min and mean are every input's, the top-10 overlap ranks the whole set); the costly shapes, mixed and padded
batches, run on a subset of the inputs that holds every long document (gate_shapes.py ``COSTLY``).

The gate can fail: an output that is not finite (NaN, infinity), in any batch shape, fails it, and so does a figure
that is NaN (a NaN compared with a bound is no pass). torch fp32 itself answering a non-finite output is refused as
the model's fault, not the conversion's.

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
task object's (core/tasks/: ``*_task.py``); this module runs the batch shapes and measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd.core.agreement import cosine_rows, overlap_at_k
from inferd.core.backends.base import BackendError, Runner
from inferd.core.backends.gate_figures import Figures, GateFigures, ScoreFigures
from inferd.core.backends.gate_inputs import BUILTIN_SEED, OVERLAP_K, GatedTask, encode_set, filler_for
from inferd.core.backends.gate_shapes import Tally, on, outputs, outputs_of, plans, subset
from inferd.core.preprocess import Encoded
from inferd.core.tasks.embedding_task import DEFAULT_OUTPUTS
from inferd.core.tasks.kinds import outputs_given, task_of


def measure(probe: GatedTask, reference: Runner, candidate: Runner, texts: Sequence[str],
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


def reference_outputs(probe: GatedTask, reference: Runner, items: list[Encoded], plan: list[list[int]],
                      filler: Encoded, tally: Tally) -> np.ndarray:
    ref = outputs(probe, reference, items, plan, filler, tally)
    if bad := nonfinite_rows(ref):
        raise BackendError(f"torch fp32 itself answers NaN or infinity for {bad} of the gate's {len(ref)} inputs: "
                           "the model (its weights or config.json), not a conversion, is what is wrong")
    return ref


def measure_scores(probe: GatedTask, reference: Runner, candidate: Runner, texts: Sequence[str],
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


def measure_embeddings(probe: GatedTask, reference: Runner, candidate: Runner, texts: Sequence[str],
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


def measure_outputs(probe: GatedTask, reference: Runner, candidate: Runner, texts: Sequence[str],
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
