"""The task objects by name: the one place a task's or an output's name is looked up. A new task is its
``*_task.py`` and a line in ``TASKS`` (and its handler a line in handlers.py ``HANDLERS``); a new embedding output
its ``Output`` and a line in ``OUTPUTS``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from inferd.core.agreement import Bound
from inferd.core.tasks.classification_task import CLASSIFICATION, LabelDrift, label_figures
from inferd.core.tasks.drift import Drift, Worst
from inferd.core.tasks.embedding_task import DENSE, EMBEDDING, MULTIVECTOR, SPARSE, TOKEN_STATES
from inferd.core.tasks.rerank_task import RERANK
from inferd.core.tasks.task import Output, Task

# One object per task (a route family's table of what it does per task is keyed by these, never by the name).
TASKS: dict[str, Task] = {t.name: t for t in (EMBEDDING, RERANK, CLASSIFICATION)}
OUTPUTS: dict[str, Output] = {o.name: o for o in (DENSE, SPARSE, MULTIVECTOR, TOKEN_STATES)}


class PluginTask(Task):
    """A plug-in handler's own task (``model.task: package.module:Class``), which inferd knows nothing of: its
    answers are compared as rows of scores (label decisions, in the gate and the drift report) and held to the
    dense vector's bounds, which its figures do not name: so the gate judges none of them and a shadow report
    never has them measured: what a plug-in's answers mean is its own, and no figure inferd computes would say it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        return DENSE.bounds(kind, gate)

    def drift(self, worst: Worst, labels: Sequence[str] | None, multi_label: bool, window: int,
              neighbours: int) -> Drift:
        return LabelDrift(worst, labels, multi_label)

    def gate_figures(self, reference: Any, got: Any, multi_label: bool) -> dict[str, float]:
        return label_figures(reference, got, multi_label)


@cache
def task_of(name: str) -> Task:
    """The task object of a task's name (a built-in's, or a plug-in's own)."""
    return TASKS.get(name) or PluginTask(name)


def outputs_given(values: Mapping[str, Any]) -> list[Output]:
    """The outputs a model's values (output name -> values) hold, in ``OUTPUTS``' order (the dense vector first)."""
    return [o for o in OUTPUTS.values() if o.name in values]


def outputs_measured(figures: object) -> list[Output]:
    """The outputs a gate's figures were measured on beyond the task's own (their lead figure is there)."""
    return [o for o in OUTPUTS.values() if o is not DENSE and getattr(figures, o.lead_figure, None) is not None]
