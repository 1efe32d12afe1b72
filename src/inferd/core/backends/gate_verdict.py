"""What the accuracy gate's figures say: pass, or refuse with each figure past its bound and the cause.

The bounds are the task object's and, for a model of several outputs, each measured output's (core/tasks/:
``bounds``), read from ``model.gate.*`` for the graph's kind (fp32, half, int8). A refusal says whether the graph
computes something else than torch (``WRONG_GRAPH``: a wrong mask, a wrong export — any float32 failure, a
non-finite output, or a figure below what any rounding gives) or is merely less precise than the bound
(``LESS_PRECISE``). The summary prints the figures the rules judge, each with its bound, and no other: a figure no
rule judges reads as a pass whatever its value.
"""

from __future__ import annotations

from inferd.core.agreement import Bound
from inferd.core.agreement import judge as judge_figures
from inferd.core.backends.gate_figures import Figures
from inferd.core.tasks.kinds import outputs_measured, task_of
from inferd.settings import GateSettings

# Figures no rounding reaches: reduced precision's worst, one MiniLM text at cosine 0.66 with static int8 and bf16
# float parts on a Xeon with AMX (bench/RESULTS.md, "Backends"), stays above them; below them a graph is told apart
# as a wrong one, whatever its precision.
WRONG_BELOW = {"cosine_min": 0.5, "spearman_mean": 0.5, "label_agreement": 0.5}
_FIGURE_NAMES = {"cosine_min": "cosine min", "cosine_mean": "cosine mean", "overlap_at_10": "overlap@10",
                 "spearman_mean": "Spearman mean", "top3_agreement": "top-3 agreement",
                 "label_agreement": "label agreement", "score_diff_max": "max diff",
                 "sparse_top10": "sparse top-10 term agreement", "weight_diff_max": "sparse weight diff",
                 "maxsim_spearman": "MaxSim Spearman mean", "maxsim_top3": "MaxSim top-3 agreement"}
WRONG_GRAPH = "wrong graph"
LESS_PRECISE = "less precise than the bound"


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
