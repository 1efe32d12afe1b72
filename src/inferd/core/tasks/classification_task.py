"""The classification task: probabilities per label, judged by the decisions they lead to.

- the gate: the share of texts given torch fp32's label (for a multi-label model, of label decisions at 0.5), and
  the largest probability difference;
- the drift report: label agreement, probability deltas and the confusion matrix (active label -> candidate's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd.core.agreement import Bound, label_agreement, labels_of
from inferd.core.tasks.drift import Drift, Request, Stat, Worst
from inferd.core.tasks.task import Task


class ClassificationTask(Task):
    name = "classification"

    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        return [Bound("label_agreement", "classification_agreement_min", gate.classification_agreement_min),
                Bound("score_diff_max", f"{kind}_probability_diff_max",
                      getattr(gate, f"{kind}_probability_diff_max"), True)]

    def drift(self, worst: Worst, labels: Sequence[str] | None, multi_label: bool, window: int,
              neighbours: int) -> Drift:
        return LabelDrift(worst, labels, multi_label)

    def gate_figures(self, reference: np.ndarray, got: np.ndarray, multi_label: bool) -> dict[str, float]:
        return label_figures(reference, got, multi_label)


CLASSIFICATION = ClassificationTask()


def label_figures(reference: np.ndarray, got: np.ndarray, multi_label: bool) -> dict[str, float]:
    """The share of decisions that agree, and the largest probability difference."""
    agree = float(label_agreement(reference, got, multi_label).mean())
    return {"label_agreement": round(agree, 6), "score_diff_max": round(float(np.abs(reference - got).max()), 7)}


class LabelDrift(Drift):
    def __init__(self, worst: Worst, labels: Sequence[str] | None, multi_label: bool) -> None:
        super().__init__(worst)
        self.labels, self.multi_label = labels, multi_label
        self.agree, self.delta = Stat(), Stat()
        self.confusion: dict[tuple[str, str], int] = {}

    def add(self, a: np.ndarray, b: np.ndarray, request: Request) -> dict[str, Any]:
        agree = label_agreement(a, b, self.multi_label)
        self.agree.add(agree)
        deltas = np.abs(a - b).max(axis=1)
        self.delta.add(deltas)
        names = self.labels or [str(i) for i in range(a.shape[1])]
        if not self.multi_label:
            la, lb = labels_of(a, False), labels_of(b, False)
            for x, y in zip(la.tolist(), lb.tolist(), strict=True):
                key = (names[x], names[y])
                self.confusion[key] = self.confusion.get(key, 0) + 1
        for i in range(len(a)):
            self.worst.note(float(deltas[i]) + 1.0 - float(agree[i]), request.request_id, i, request.tokens,
                            request.inputs, probability_delta=deltas[i], agrees=float(agree[i]))
        return {"agree": agree.tolist(), "probability_delta": deltas.tolist()}

    def figures(self) -> dict[str, float | None]:
        return {"label_agreement": self.agree.as_dict()["mean"], "probability_delta_max": self.delta.as_dict()["max"]}

    def sections(self) -> dict[str, Any]:
        return {"label_agreement": self.agree.as_dict(), "probability_delta": self.delta.as_dict(),
                "confusion": [{"active": x, "shadow": y, "count": n} for (x, y), n in sorted(self.confusion.items())]}
