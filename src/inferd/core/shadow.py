"""Shadow traffic: a candidate model computes a share of live requests beside the active one, and the drift
report says what it would change for users before anyone sees its answers.

The candidate's answers are never returned: admission mirrors a sampled request after its live answer is
computed (core/shadow_mirror.py), into a bounded lane of its own that runs only while no live lane has work
(core/batcher.py), and each pair of answers is folded into the report here. Everything in this module is a
pure function of the two models' outputs, or a bounded accumulator of them, so it is tested against an
offline computation on the same outputs (tests/unit/test_shadow.py).

What is compared is the task's own (core/tasks/: each task's ``Drift``, chosen once when the report is made):
cosine and neighbourhood agreement of embeddings, each query's ranking of its documents, label agreement and the
confusion matrix of a classifier.

The measures and the judge of a figure against its bound are the accuracy gate's own (core/agreement.py, the
task's bounds);
the verdict (``verdict``) holds the report to the gate's agreement bounds (model.gate.*) and to a minimum
amount of traffic before a promotion may proceed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.core.agreement import Bound, judge
from inferd.core.scheduler import Policy
from inferd.core.tasks.drift import Drift, Request, Worst
from inferd.core.tasks.kinds import task_of

if TYPE_CHECKING:  # the fleet's CLI aggregates reports without torch, which slots imports
    from inferd.core.slots import ModelSlot

# An embedding report's neighbourhood window (bounded: a candidate may shadow for days) and neighbours per text.
WINDOW = 256
NEIGHBOURS = 10
# The fewest texts (or pairs) a report must be based on before it may decide a promotion; the shadow lane's
# bound, in items. Settings may override both (shadow.min_items, shadow.max_queue).
MIN_ITEMS = 100
MAX_QUEUE = 256
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
    _worst: Worst = field(init=False)
    _drift: Drift = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._worst = Worst(self.log_inputs)
        self._drift = task_of(self.task).drift(self._worst, self.labels, self.multi_label, self.window,
                                               self.neighbours)

    # -- counts ----------------------------------------------------------------------------------------

    def count(self, outcome: str) -> None:
        """sampled, shed (queue full, deadline, drained), failed (the candidate's batch failed)."""
        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + 1)

    # -- one request's two answers ---------------------------------------------------------------------

    def add(self, active: Sequence[Any], shadow: Sequence[Any], request_id: str | None = None,
            tokens: Sequence[int] = (), inputs: Sequence[Any] = ()) -> dict[str, Any]:
        """Fold one request's answers (one per input, in order) in; returns its own figures. Answers the task's
        comparison cannot read (an embedding's without a dense vector: sparse or multi-vector alone, asked or all
        the candidate gives) are counted as not compared."""
        usable = self._drift.usable(active, shadow)
        if usable is None:
            with self._lock:
                self.uncompared += 1
            return {}
        a = np.asarray([np.asarray(x, dtype=np.float64) for x in usable[0]])
        b = np.asarray([np.asarray(x, dtype=np.float64) for x in usable[1]])
        with self._lock:
            self.computed += 1
            self.items += len(a)
            return self._drift.add(a, b, Request(request_id, tokens, inputs))

    # -- reading ---------------------------------------------------------------------------------------

    def figures(self) -> dict[str, float | None]:
        """The figures the verdict reads (None: not measured yet)."""
        with self._lock:
            return self._figures()

    def _figures(self) -> dict[str, float | None]:
        return self._drift.figures()

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "task": self.task, "version": self.version,
                "requests": {"sampled": self.sampled, "computed": self.computed, "shed": self.shed,
                             "failed": self.failed, **({"uncompared": self.uncompared} if self.uncompared else {})},
                "items": self.items, "figures": self._figures(), "most_drifted": self._worst.items()}
            if self.uncompared:
                out["uncompared"] = (f"{self.uncompared} requests were not compared: they asked only sparse or "
                                     "multi-vector outputs, or the candidate gives no dense vector; the shadow "
                                     "report judges dense vectors only")
            out.update(self._drift.sections())
            return out


# -- the verdict ------------------------------------------------------------------------------------------


# The live figure the gate's names for: the shadow measures neighbours among recent texts, not on the gate's set.
_LIVE_NAMES = {"overlap_at_10": "overlap_mean"}


def bounds(task: str, gate: Any) -> list[Bound]:
    """The bounds a shadowed candidate is held to: the accuracy gate's loosest accepted agreement (int8's; an
    int8 model the gate passes keeps the space, and live traffic must show it too), under the shadow report's
    names. The gate's difference bounds are not among them: its differences are relative to torch's range over
    its own set, which live traffic has not."""
    return [replace(b, figure=_LIVE_NAMES.get(b.figure, b.figure)) for b in task_of(task).bounds("int8", gate)
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
