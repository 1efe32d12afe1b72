"""Shadow traffic: a candidate model computes a share of live requests beside the active one, and the drift
report says what it would change for users before anyone sees its answers.

The candidate's answers are never returned: admission mirrors a sampled request after its live answer is
computed (core/admission.py), into a bounded lane of its own that runs only while no live lane has work
(core/batcher.py), and each pair of answers is folded into the report here. Everything in this module is a
pure function of the two models' outputs, or a bounded accumulator of them, so it is tested against an
offline computation on the same outputs (tests/unit/test_shadow.py).

- embedding: cosine per text between the two models' vectors (count, mean, min, percentiles, a histogram),
  and neighbourhood agreement: of each text's k nearest texts among a rolling window of recent texts, the
  share both spaces agree on (what tells a user whether their index still answers queries);
- rerank: per request (one query and its documents) the Spearman correlation of the two models' scores,
  top-3 agreement, and the score deltas;
- classification: label agreement, probability deltas and the confusion matrix (active label -> candidate's).

The measures and the judge of a figure against its bound are the accuracy gate's own (core/agreement.py);
the verdict (``verdict``) holds the report to the gate's agreement bounds (model.gate.*) and to a minimum
amount of traffic before a promotion may proceed.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.core.agreement import (
    Bound,
    cosine_rows,
    judge,
    label_agreement,
    labels_of,
    neighbour_overlap,
    ranking,
    unit_rows,
)
from inferd.core.agreement import bounds as gate_bounds
from inferd.core.batcher import Policy
from inferd.core.outputs import TextOutputs

if TYPE_CHECKING:  # the fleet's CLI aggregates reports without torch, which slots imports
    from inferd.core.slots import ModelSlot

# Bounds of what the report keeps (a candidate may shadow for days): the neighbourhood window, the cosines
# the percentiles are taken over, and the most-drifted items listed.
WINDOW = 256
NEIGHBOURS = 10
RECENT = 10_000
WORST = 10
# The fewest texts (or pairs) a report must be based on before it may decide a promotion; the shadow lane's
# bound, in items. Settings may override both (shadow.min_items, shadow.max_queue).
MIN_ITEMS = 100
MAX_QUEUE = 256
# Cosine histogram edges: most of the interesting range is between 0.99 and 1.
COSINE_EDGES = (-1.0, 0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9999, 1.0)
PERCENTILES = (1, 5, 50)
# The shadow lane of a model's queue, and the priority its items carry: below any request's (-100 lowest).
SHADOW_SUFFIX = "#shadow"
SHADOW_PRIORITY = -1000
SHADOW_TIMEOUT_S = 30.0


def shadow_lane(model: str) -> str:
    return model + SHADOW_SUFFIX


def shadow_policy(live: Policy, settings: Any) -> Policy:
    """The shadow lane's batching rules: the model's own, in batches no larger than shadow.max_batch_size and
    shadow.max_batch_tokens, and no wait for companions. Its batches run only while no live lane holds work,
    but one that is running is not interrupted: a live request arriving then waits for it, so its size is
    the delay shadow work can add to a live answer."""
    return replace(live, max_batch_size=min(live.max_batch_size, settings.max_batch_size),
                   max_batch_tokens=min(live.max_batch_tokens, settings.max_batch_tokens), max_wait_ms=0.0)


# -- the report -------------------------------------------------------------------------------------------


@dataclass
class _Stat:
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
class DriftReport:
    """What shadow traffic has shown of one candidate, for its whole life (bounded). Thread-safe."""

    task: str
    version: str
    labels: list[str] | None = None
    multi_label: bool = False
    log_inputs: bool = False
    window: int = WINDOW
    neighbours: int = NEIGHBOURS
    sampled: int = 0
    computed: int = 0
    shed: int = 0
    failed: int = 0
    # Requests whose outputs the report cannot compare: sparse or multi-vector only (it judges dense vectors).
    uncompared: int = 0
    items: int = 0
    cosine: _Stat = field(default_factory=_Stat)
    overlap: _Stat = field(default_factory=_Stat)
    spearman: _Stat = field(default_factory=_Stat)
    top3: _Stat = field(default_factory=_Stat)
    delta: _Stat = field(default_factory=_Stat)
    agree: _Stat = field(default_factory=_Stat)
    histogram: list[int] = field(default_factory=lambda: [0] * (len(COSINE_EDGES) - 1))
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    confusion: dict[tuple[str, str], int] = field(default_factory=dict)
    # The most-drifted items: a heap of (-drift, seq, item) keeping the WORST largest drifts.
    _worst: list[tuple[float, int, dict[str, Any]]] = field(default_factory=list)
    _seq: int = 0
    _win_a: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    _win_b: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._win_a = deque(maxlen=self.window)
        self._win_b = deque(maxlen=self.window)

    # -- counts ----------------------------------------------------------------------------------------

    def count(self, outcome: str) -> None:
        """sampled, shed (queue full, deadline, drained), failed (the candidate's batch failed)."""
        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + 1)

    # -- one request's two answers ---------------------------------------------------------------------

    def add(self, active: Sequence[Any], shadow: Sequence[Any], request_id: str | None = None,
            tokens: Sequence[int] = (), inputs: Sequence[Any] = ()) -> dict[str, Any]:
        """Fold one request's answers (one per input, in order) in; returns its own figures. An embedding answer
        of several outputs (core/outputs.py) is compared by its dense vector; one without (sparse or multi-vector
        alone, asked or all the candidate gives) is counted as not compared, never read as a vector."""
        if self.task == "embedding":
            active, shadow = [_dense(x) for x in active], [_dense(x) for x in shadow]
            if any(x is None for x in (*active, *shadow)):
                with self._lock:
                    self.uncompared += 1
                return {}
        a = np.asarray([np.asarray(x, dtype=np.float64) for x in active])
        b = np.asarray([np.asarray(x, dtype=np.float64) for x in shadow])
        with self._lock:
            self.computed += 1
            self.items += len(a)
            if self.task == "embedding":
                return self._add_embeddings(a, b, request_id, tokens, inputs)
            if self.task == "rerank":
                return self._add_ranking(a[:, 0], b[:, 0], request_id, tokens, inputs)
            return self._add_labels(a, b, request_id, tokens, inputs)

    def _note(self, drift: float, request_id: str | None, index: int, tokens: Sequence[int],
              inputs: Sequence[Any], **figures: float) -> None:
        item: dict[str, Any] = {"request_id": request_id, "index": index,
                                "tokens": tokens[index] if index < len(tokens) else None,
                                **{k: round(float(v), 7) for k, v in figures.items()}}
        if self.log_inputs and index < len(inputs):
            item["input"] = inputs[index] if isinstance(inputs[index], str) else list(inputs[index])
        self._seq += 1
        entry = (drift, -self._seq, item)
        if len(self._worst) < WORST:
            heapq.heappush(self._worst, entry)
        elif drift > self._worst[0][0]:
            heapq.heapreplace(self._worst, entry)

    def _add_embeddings(self, a: np.ndarray, b: np.ndarray, request_id: str | None, tokens: Sequence[int],
                        inputs: Sequence[Any]) -> dict[str, Any]:
        cos = cosine_rows(a, b)
        self.cosine.add(cos)
        self.recent.extend(cos.tolist())
        hist, _ = np.histogram(np.clip(cos, -1.0, 1.0), bins=COSINE_EDGES)
        self.histogram = [h + int(n) for h, n in zip(self.histogram, hist, strict=True)]
        ua, ub = unit_rows(a), unit_rows(b)
        overlaps = []
        for i in range(len(a)):
            overlap = None
            if len(self._win_a) >= self.neighbours:
                overlap = neighbour_overlap(np.asarray(self._win_a), np.asarray(self._win_b), ua[i], ub[i],
                                            self.neighbours)
                overlaps.append(overlap)
            self._win_a.append(ua[i])
            self._win_b.append(ub[i])
            extra = {} if overlap is None else {"overlap": overlap}
            self._note(1.0 - float(cos[i]), request_id, i, tokens, inputs, cosine=cos[i], **extra)
        self.overlap.add(overlaps)
        return {"cosine": cos.tolist(), "overlap": overlaps}

    def _add_ranking(self, a: np.ndarray, b: np.ndarray, request_id: str | None, tokens: Sequence[int],
                     inputs: Sequence[Any]) -> dict[str, Any]:
        deltas = np.abs(a - b)
        self.delta.add(deltas)
        out: dict[str, Any] = {"score_delta_max": float(deltas.max()) if len(deltas) else 0.0}
        if len(a) >= 2:
            figures = ranking(a, b)
            self.spearman.add([figures["spearman"]])
            self.top3.add([figures["top3"]])
            out.update(figures)
        worst = int(deltas.argmax()) if len(deltas) else 0
        self._note(float(deltas.max()) if len(deltas) else 0.0, request_id, worst, tokens, inputs,
                   spearman=out.get("spearman", 1.0), score_delta=out["score_delta_max"])
        return out

    def _add_labels(self, a: np.ndarray, b: np.ndarray, request_id: str | None, tokens: Sequence[int],
                    inputs: Sequence[Any]) -> dict[str, Any]:
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
            self._note(float(deltas[i]) + 1.0 - float(agree[i]), request_id, i, tokens, inputs,
                       probability_delta=deltas[i], agrees=float(agree[i]))
        return {"agree": agree.tolist(), "probability_delta": deltas.tolist()}

    # -- reading ---------------------------------------------------------------------------------------

    def figures(self) -> dict[str, float | None]:
        """The figures the verdict reads (None: not measured yet)."""
        with self._lock:
            return self._figures()

    def _figures(self) -> dict[str, float | None]:
        if self.task == "embedding":
            recent = np.asarray(self.recent) if self.recent else None
            return {"cosine_mean": self.cosine.as_dict()["mean"], "cosine_min": self.cosine.as_dict()["min"],
                    "cosine_p1": None if recent is None else round(float(np.percentile(recent, 1)), 7),
                    "overlap_mean": self.overlap.as_dict()["mean"]}
        if self.task == "rerank":
            return {"spearman_mean": self.spearman.as_dict()["mean"], "top3_agreement": self.top3.as_dict()["mean"],
                    "score_delta_max": self.delta.as_dict()["max"]}
        return {"label_agreement": self.agree.as_dict()["mean"], "probability_delta_max": self.delta.as_dict()["max"]}

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "task": self.task, "version": self.version,
                "requests": {"sampled": self.sampled, "computed": self.computed, "shed": self.shed,
                             "failed": self.failed, **({"uncompared": self.uncompared} if self.uncompared else {})},
                "items": self.items, "figures": self._figures(),
                "most_drifted": [e[2] for e in sorted(self._worst, key=lambda e: (-e[0], -e[1]))]}
            if self.uncompared:
                out["uncompared"] = (f"{self.uncompared} requests were not compared: they asked only sparse or "
                                     "multi-vector outputs, or the candidate gives no dense vector; the shadow "
                                     "report judges dense vectors only")
            if self.task == "embedding":
                recent = np.asarray(self.recent) if self.recent else None
                out["cosine"] = {**self.cosine.as_dict(), "percentiles": {
                    f"p{p}": (None if recent is None else round(float(np.percentile(recent, p)), 7))
                    for p in PERCENTILES}, "histogram": {"edges": list(COSINE_EDGES), "counts": list(self.histogram)}}
                out["neighbours"] = {"k": self.neighbours, "window": self.window, **self.overlap.as_dict()}
            elif self.task == "rerank":
                out["spearman"] = self.spearman.as_dict()
                out["top3_agreement"] = self.top3.as_dict()
                out["score_delta"] = self.delta.as_dict()
            else:
                out["label_agreement"] = self.agree.as_dict()
                out["probability_delta"] = self.delta.as_dict()
                out["confusion"] = [{"active": x, "shadow": y, "count": n}
                                    for (x, y), n in sorted(self.confusion.items())]
            return out


def _dense(output: Any) -> Any:
    """An embedding answer's dense vector (None: it holds none)."""
    return output.dense if isinstance(output, TextOutputs) else output


# -- the verdict ------------------------------------------------------------------------------------------


# The live figure the gate's names for: the shadow measures neighbours among recent texts, not on the gate's set.
_LIVE_NAMES = {"overlap_at_10": "overlap_mean"}


def bounds(task: str, gate: Any) -> list[Bound]:
    """The bounds a shadowed candidate is held to: the accuracy gate's loosest accepted agreement (int8's; an
    int8 model the gate passes keeps the space, and live traffic must show it too), under the shadow report's
    names. The gate's difference bounds are not among them: its differences are relative to torch's range over
    its own set, which live traffic has not."""
    return [replace(b, figure=_LIVE_NAMES.get(b.figure, b.figure)) for b in gate_bounds(task, "int8", gate)
            if not b.upper]


@dataclass(frozen=True)
class Verdict:
    code: str | None  # None: promotion may proceed; shadow_insufficient or shadow_drifted
    reasons: list[str]

    @property
    def ok(self) -> bool:
        return self.code is None


def verdict(task: str, items: int, figures: dict[str, float | None], gate: Any,
            min_items: int = MIN_ITEMS) -> Verdict:
    """Whether a candidate's report allows its promotion: enough traffic, and every figure within its bound.

    ``items`` and ``figures`` may be one worker's report or several workers' aggregated (``aggregate``).
    """
    if items < min_items:
        return Verdict("shadow_insufficient", [f"the report is based on {items} items; at least {min_items} "
                                               "are needed (shadow.min_items)"])
    failures, missing = judge(figures, bounds(task, gate))
    unmeasured = [f"{b.figure} not measured yet (needs more traffic)" for b in missing]
    if not failures:
        return Verdict("shadow_insufficient" if unmeasured else None, unmeasured)
    return Verdict("shadow_drifted", failures + unmeasured)


def aggregate(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' reports of one candidate (``DriftReport.as_dict``): counts summed, the worst figure
    taken (the lowest; the highest for deltas), so one worker's drift is never averaged away."""
    counts = {k: sum(r["requests"][k] for r in reports) for k in ("sampled", "computed", "shed", "failed")}
    figures: dict[str, float | None] = {}
    for r in reports:
        for name, value in r["figures"].items():
            if value is None:
                figures.setdefault(name, None)
                continue
            old = figures.get(name)
            worse = max if "delta" in name else min
            figures[name] = value if old is None else worse(old, value)
    return {"task": reports[0]["task"] if reports else None, "requests": counts,
            "items": sum(r["items"] for r in reports), "figures": figures, "workers": len(reports)}


@dataclass(eq=False)
class Shadow:
    """A model's shadow candidate: its slot (held by the manager), the share sampled, and its report."""

    slot: ModelSlot
    weight: float
    report: DriftReport
