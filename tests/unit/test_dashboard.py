"""The Grafana dashboard queries only metrics the service exports, and covers what operators look at."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from settingskit import make_settings

from inferd.api.app import create_app
from inferd.api.services import services_of

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "inferd.json"

_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_NAME = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)\s*(\()?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords or labels."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    names = set()
    for match in _NAME.finditer(text):
        name, call = match.groups()
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def base_name(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def dashboard_exprs() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(data["panels"])
    return exprs


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every metric family name the app's /metrics exposition declares (what /metrics serves)."""
    settings = make_settings(tmp_path_factory.mktemp("m"), layered="dev", model={"device": "cpu"})
    app = create_app(settings)  # not started: the registry is complete at construction
    text = generate_latest(services_of(app).metrics.registry).decode()
    return {family.name for family in text_string_to_metric_families(text)}


def test_metric_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, version) (rate(inferd_x_bucket{endpoint=~"/a|b",le!="1"}'
            '[$__rate_interval]))) / on (version) group_left sum(inferd_y) * 1e3 + avg_over_time(up[5m] offset 1h)')
    assert metric_names(expr) == {"inferd_x_bucket", "inferd_y", "up"}
    assert base_name("inferd_requests_total") == "inferd_requests"
    assert base_name("inferd_batch_size_bucket") == "inferd_batch_size"


def test_every_queried_metric_is_exported(exported: set[str]) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    queried = set().union(*(metric_names(e) for e in exprs))
    missing = sorted(n for n in queried if base_name(n) not in exported and n not in exported)
    assert not missing, f"the dashboard queries metrics the service does not export: {missing}"


def test_dashboard_covers_the_operators_questions(exported: set[str]) -> None:
    queried = {base_name(n) for e in dashboard_exprs() for n in metric_names(e)}
    wanted = {
        "inferd_requests",  # QPS
        "inferd_request_duration_seconds",  # P50 / P99
        "inferd_batch_size",  # batch size distribution
        "inferd_queue_depth",
        "inferd_queue_duration_seconds", "inferd_preprocess_duration_seconds",
        "inferd_inference_duration_seconds", "inferd_postprocess_duration_seconds",
        "inferd_gpu_memory_allocated_bytes", "inferd_gpu_memory_reserved_bytes", "inferd_gpu_utilization_ratio",
        "inferd_version_requests",  # per model version
    }
    assert wanted <= queried, sorted(wanted - queried)
    exprs = " ".join(dashboard_exprs())
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs


def test_dashboard_is_grafana_json_with_a_version_variable() -> None:
    data = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert {"datasource", "version"} <= set(variables)
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert any('version=~"$version"' in e for e in dashboard_exprs())
