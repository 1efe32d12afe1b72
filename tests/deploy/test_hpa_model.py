"""bench/hpa_model.py decides as the Kubernetes HPA controller does: the cases of its replica calculator and
behavior normalisation (k8s.io/kubernetes pkg/controller/podautoscaler), worked out by hand."""

from __future__ import annotations

import sys

import pytest

from .k8s_objects import ROOT, Docs, one

sys.path.insert(0, str(ROOT / "bench"))

from hpa_model import (  # noqa: E402
    DEFAULT_TOLERANCE,
    Controller,
    HpaSpec,
    Policy,
    Rules,
    Target,
    metric_proposal,
    spec_from_manifest,
)

TOL = DEFAULT_TOLERANCE


@pytest.mark.parametrize(("current", "values", "target", "expected"), [
    (2, [4.3, 4.3], 4, 2),           # ratio 1.075: within the 0.1 tolerance, no change
    (2, [10, 10], 4, 5),             # ceil(2.5 x 2)
    (3, [1, 1, 1], 4, 1),            # ceil(0.25 x 3)
    (2, [10, None], 4, 3),           # scale-up: the missing pod counts as 0 -> ratio 1.25 over 2 pods
    (3, [1, 1, None], 4, 2),         # scale-down: the missing pod counts as the target -> 0.5 x 3
    (3, [5, None, None], 4, 3),      # up (1.25) turns down (0.42) with the missing pods: no change
    (2, [None, None], 4, None),      # no metric at all: the metric gives no proposal
])
def test_metric_proposal(current: int, values: list[float | None], target: float, expected: int | None) -> None:
    assert metric_proposal(current, values, target, TOL, TOL) == expected


def spec(up_window: int = 0, down_window: int = 300) -> HpaSpec:
    return HpaSpec(2, 10, (Target("q", 4.0), Target("busy", 0.7)),
                   Rules(up_window, "Max", (Policy("Percent", 100, 60), Policy("Pods", 2, 60))),
                   Rules(down_window, "Min", (Policy("Pods", 1, 120),)))


def test_the_largest_metric_proposal_wins_and_scale_up_is_rate_limited() -> None:
    hpa = Controller(spec())
    first = hpa.sync(0, 2, {"q": [20, 20], "busy": [0.9, 0.9]})
    assert first.proposals == {"q": 10, "busy": 3} and first.recommended == 10
    assert first.replicas == 4                      # max(+100 %, +2 pods) over the 60 s period
    again = hpa.sync(15, 4, {"q": [20, 20, 0, 0], "busy": [0.9, 0.9, None, None]})
    assert again.replicas == 4                      # the period's budget is spent
    later = hpa.sync(61, 4, {"q": [20, 20, 20, 20], "busy": [1, 1, 1, 1]})
    assert later.replicas == 8                      # a new period: double again


def test_scale_down_waits_for_the_window_then_goes_one_pod_per_period() -> None:
    hpa = Controller(spec())
    assert hpa.sync(0, 6, {"q": [4] * 6, "busy": [0.7] * 6}).replicas == 6
    low = {"q": [0.1] * 6, "busy": [0.2] * 6}
    for t in range(15, 300, 15):
        assert hpa.sync(t, 6, low).replicas == 6, t   # the 6 recommended at t=0 is inside the window
    assert hpa.sync(301, 6, low).replicas == 5
    assert hpa.sync(316, 5, {"q": [0.1] * 5, "busy": [0.2] * 5}).replicas == 5   # 1 pod per 120 s
    assert hpa.sync(422, 5, {"q": [0.1] * 5, "busy": [0.2] * 5}).replicas == 4
    assert hpa.sync(1000, 2, {"q": [0.0] * 2, "busy": [0.0] * 2}).replicas == 2  # never below minReplicas


def test_an_unreadable_metric_blocks_a_scale_down() -> None:
    hpa = Controller(spec(down_window=0))
    assert hpa.sync(0, 5, {"q": [0.1] * 5, "busy": [None] * 5}).replicas == 5
    assert hpa.sync(15, 5, {"q": [0.1] * 5, "busy": [0.1] * 5}).replicas == 4


def test_the_up_window_takes_the_lowest_recent_recommendation() -> None:
    hpa = Controller(spec(up_window=30))
    assert hpa.sync(0, 2, {"q": [4] * 2, "busy": [0.7] * 2}).replicas == 2
    assert hpa.sync(15, 2, {"q": [20] * 2, "busy": [0.7] * 2}).replicas == 2  # 2 is still in the window
    assert hpa.sync(31, 2, {"q": [20] * 2, "busy": [0.7] * 2}).replicas == 4


def test_spec_is_read_from_the_built_cpu_hpa(built: dict[str, Docs]) -> None:
    hpa = one(built["overlays/cpu"], "HorizontalPodAutoscaler")
    spec_ = spec_from_manifest(hpa)
    assert (spec_.min_replicas, spec_.max_replicas) == (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
    assert [t.name for t in spec_.targets] == ["inferd_queue_depth", "inferd_worker_busy_ratio"]
    assert spec_.down.window_s == hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert spec_.up.tolerance == spec_.down.tolerance == TOL   # not set in the manifest: the cluster default
    assert spec_.targets[1].average == pytest.approx(0.7)


def test_missing_behavior_takes_the_api_defaults() -> None:
    spec_ = spec_from_manifest({"spec": {"maxReplicas": 5, "metrics": [
        {"type": "Pods", "pods": {"metric": {"name": "q"}, "target": {"type": "AverageValue", "averageValue": "1"}}}]}})
    assert spec_.min_replicas == 1
    assert (spec_.up.window_s, spec_.down.window_s) == (0, 300)
    assert Policy("Pods", 4, 15) in spec_.up.policies
