"""The HorizontalPodAutoscaler's decision for Pods metrics, as kube-controller-manager makes it (autoscaling/v2).

Follows pkg/controller/podautoscaler in Kubernetes: per metric, desired = ceil(ratio x pods with metrics) with
ratio = average / target, unchanged within the tolerance, with the missing-pod rule (missing counts as 0 on a
scale-up and as the target on a scale-down, and a flip of direction cancels); the largest proposal over the
metrics wins; then the behavior: the stabilisation windows (the lowest recommendation of the scale-up window,
the highest of the scale-down window) and the rate policies (change allowed per period, counted from the
scale events of that period). bench/autoscale_sim.py drives it with a real inferd's metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TOLERANCE = 0.1  # kube-controller-manager --horizontal-pod-autoscaler-tolerance


def quantity(value: str | int | float) -> float:
    text = str(value)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


@dataclass(frozen=True)
class Policy:
    kind: str  # Pods | Percent
    value: int
    period_s: int


@dataclass(frozen=True)
class Rules:
    window_s: int
    select: str  # Max | Min | Disabled
    policies: tuple[Policy, ...]
    tolerance: float = DEFAULT_TOLERANCE


@dataclass(frozen=True)
class Target:
    name: str
    average: float


@dataclass(frozen=True)
class HpaSpec:
    min_replicas: int
    max_replicas: int
    targets: tuple[Target, ...]
    up: Rules
    down: Rules


# The API server's defaults for a behavior that leaves a direction (or its fields) out.
_DEFAULT_UP = {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
               "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15},
                            {"type": "Pods", "value": 4, "periodSeconds": 15}]}
_DEFAULT_DOWN = {"stabilizationWindowSeconds": 300, "selectPolicy": "Max",
                 "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}]}


def _rules(given: Mapping[str, Any] | None, default: Mapping[str, Any]) -> Rules:
    merged = {**default, **(given or {})}
    return Rules(int(merged["stabilizationWindowSeconds"]), str(merged["selectPolicy"]),
                 tuple(Policy(p["type"], int(p["value"]), int(p["periodSeconds"])) for p in merged["policies"]),
                 quantity(merged["tolerance"]) if "tolerance" in merged else DEFAULT_TOLERANCE)


def spec_from_manifest(hpa: Mapping[str, Any]) -> HpaSpec:
    """An autoscaling/v2 HorizontalPodAutoscaler object (as built by kustomize) with Pods metrics."""
    spec = hpa["spec"]
    targets = []
    for metric in spec["metrics"]:
        if metric["type"] != "Pods" or metric["pods"]["target"]["type"] != "AverageValue":
            raise ValueError(f"only Pods metrics with AverageValue targets are modelled, not {metric}")
        targets.append(Target(metric["pods"]["metric"]["name"], quantity(metric["pods"]["target"]["averageValue"])))
    behavior = spec.get("behavior", {})
    return HpaSpec(int(spec.get("minReplicas", 1)), int(spec["maxReplicas"]), tuple(targets),
                   _rules(behavior.get("scaleUp"), _DEFAULT_UP), _rules(behavior.get("scaleDown"), _DEFAULT_DOWN))


def metric_proposal(current: int, values: Sequence[float | None], target: float, up_tolerance: float,
                    down_tolerance: float) -> int | None:
    """One metric's replica count; ``values`` has one entry per running pod, None where it has no metric yet.
    None when no pod has a metric (the HPA then cannot use this metric)."""
    present = [v for v in values if v is not None]
    missing = len(values) - len(present)
    if not present:
        return None
    ratio = sum(present) / len(present) / target
    tolerance = down_tolerance if ratio < 1 else up_tolerance
    if missing == 0:
        if abs(1 - ratio) <= tolerance:
            return current
        return math.ceil(ratio * len(present))
    filled = present + [target if ratio < 1 else 0.0] * missing
    new_ratio = sum(filled) / len(filled) / target
    if abs(1 - new_ratio) <= tolerance or (ratio < 1 < new_ratio) or (ratio > 1 > new_ratio):
        return current
    proposal = math.ceil(new_ratio * len(filled))
    if (new_ratio < 1 and proposal > current) or (new_ratio > 1 and proposal < current):
        return current
    return proposal


@dataclass
class Decision:
    """One sync: each metric's proposal, their maximum, after stabilisation, and the count set."""

    t: float
    current: int
    proposals: dict[str, int | None]
    recommended: int
    stabilized: int
    replicas: int


@dataclass
class Controller:
    spec: HpaSpec
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    up_events: list[tuple[float, int]] = field(default_factory=list)
    down_events: list[tuple[float, int]] = field(default_factory=list)

    def sync(self, now: float, current: int, values: Mapping[str, Sequence[float | None]]) -> Decision:
        spec = self.spec
        proposals = {t.name: metric_proposal(current, values.get(t.name, []), t.average, spec.up.tolerance,
                                             spec.down.tolerance) for t in spec.targets}
        valid = [p for p in proposals.values() if p is not None]
        recommended = max(valid) if valid else current
        # A metric that could not be read blocks a scale-down (it might have asked for more).
        if len(valid) < len(proposals) and recommended < current:
            recommended = current
        if current > spec.max_replicas:
            recommended = spec.max_replicas
        elif current < spec.min_replicas:
            recommended = spec.min_replicas
        stabilized = self._stabilize(now, current, recommended)
        replicas = self._rate_limit(now, current, stabilized)
        if replicas > current:
            self.up_events.append((now, replicas - current))
        elif replicas < current:
            self.down_events.append((now, current - replicas))
        return Decision(now, current, proposals, recommended, stabilized, replicas)

    def _stabilize(self, now: float, current: int, recommended: int) -> int:
        up_cut, down_cut = now - self.spec.up.window_s, now - self.spec.down.window_s
        up, down = recommended, recommended
        for t, rec in self.recommendations:
            if t > up_cut:
                up = min(up, rec)
            if t > down_cut:
                down = max(down, rec)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > min(up_cut, down_cut)]
        self.recommendations.append((now, recommended))
        return min(max(current, up), down)

    @staticmethod
    def _changed(events: list[tuple[float, int]], now: float, period_s: int) -> int:
        return sum(n for t, n in events if t > now - period_s)

    def _rate_limit(self, now: float, current: int, desired: int) -> int:
        spec = self.spec
        if desired > current:
            limit = self._limit(now, current, spec.up, up=True)
            return max(min(desired, spec.max_replicas, max(limit, current)), current)
        if desired < current:
            limit = self._limit(now, current, spec.down, up=False)
            return max(desired, spec.min_replicas, min(limit, current))
        return desired

    def _limit(self, now: float, current: int, rules: Rules, up: bool) -> int:
        if rules.select == "Disabled":
            return current
        proposals = []
        for policy in rules.policies:
            added = self._changed(self.up_events, now, policy.period_s)
            removed = self._changed(self.down_events, now, policy.period_s)
            if up:
                start = current - added + removed
                proposals.append(start + policy.value if policy.kind == "Pods"
                                 else math.ceil(start * (1 + policy.value / 100)))
            else:
                start = current + removed - added
                proposals.append(start - policy.value if policy.kind == "Pods"
                                 else int(start * (1 - policy.value / 100)))
        # Max = the policy allowing the biggest change: most pods up, fewest pods left down.
        biggest = rules.select == "Max"
        return (max if up == biggest else min)(proposals)
