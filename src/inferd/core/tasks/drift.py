"""What a drift report (core/shadow.py) keeps of one request's two answers, shared by the tasks' own comparisons
(each task's ``Drift``, chosen once when the report is made): a figure's running count, sum and extremes, and the
most-drifted items. Numpy only: the fleet's CLI aggregates reports without torch.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The most-drifted items a report lists.
WORST = 10


@dataclass
class Stat:
    """Count, sum, min and max of a figure over the candidate's life."""

    count: int = 0
    total: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")

    def add(self, values: Sequence[float] | np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        if values.size:
            self.count += int(values.size)
            self.total += float(values.sum())
            self.low = min(self.low, float(values.min()))
            self.high = max(self.high, float(values.max()))

    def as_dict(self) -> dict[str, float | None]:
        if not self.count:
            return {"count": 0, "mean": None, "min": None, "max": None}
        return {"count": self.count, "mean": round(self.total / self.count, 7), "min": round(self.low, 7),
                "max": round(self.high, 7)}


@dataclass
class Worst:
    """The WORST most-drifted items: a heap of (drift, -seq, item); an input's text only with ``log_inputs``."""

    log_inputs: bool = False
    _heap: list[tuple[float, int, dict[str, Any]]] = field(default_factory=list)
    _seq: int = 0

    def note(self, drift: float, request_id: str | None, index: int, tokens: Sequence[int], inputs: Sequence[Any],
             **figures: float) -> None:
        item: dict[str, Any] = {"request_id": request_id, "index": index,
                                "tokens": tokens[index] if index < len(tokens) else None,
                                **{k: round(float(v), 7) for k, v in figures.items()}}
        if self.log_inputs and index < len(inputs):
            item["input"] = inputs[index] if isinstance(inputs[index], str) else list(inputs[index])
        self._seq += 1
        entry = (drift, -self._seq, item)
        if len(self._heap) < WORST:
            heapq.heappush(self._heap, entry)
        elif drift > self._heap[0][0]:
            heapq.heapreplace(self._heap, entry)

    def items(self) -> list[dict[str, Any]]:
        """Most drifted first; among equals, the earliest."""
        return [e[2] for e in sorted(self._heap, key=lambda e: (-e[0], -e[1]))]


@dataclass(frozen=True)
class Request:
    """One request's identity in the report: its id, each input's tokens, and the inputs (for ``log_inputs``)."""

    request_id: str | None = None
    tokens: Sequence[int] = ()
    inputs: Sequence[Any] = ()


class Drift(ABC):
    """A task's comparison of a candidate's answers with the active model's, over the candidate's life. Not
    thread-safe: the report holds its lock around every call."""

    def __init__(self, worst: Worst) -> None:
        self.worst = worst

    def usable(self, active: Sequence[Any], shadow: Sequence[Any]) -> tuple[list[Any], list[Any]] | None:
        """The answers as this comparison reads them, or None when they hold nothing it can compare."""
        return list(active), list(shadow)

    @abstractmethod
    def add(self, a: np.ndarray, b: np.ndarray, request: Request) -> dict[str, Any]:
        """Fold one request's answers (a row per input: active ``a``, candidate ``b``) in; its own figures."""

    @abstractmethod
    def figures(self) -> dict[str, float | None]:
        """The figures the verdict reads (None: not measured yet)."""

    @abstractmethod
    def sections(self) -> dict[str, Any]:
        """The report's task-specific parts, as ``DriftReport.as_dict`` shows them."""
