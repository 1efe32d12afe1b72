"""Every object deploy/k8s builds validates: built-in kinds against the Kubernetes OpenAPI schemas (strict:
an unknown field fails, as `kubectl apply` would refuse it), custom resources against the CRD schemas kept in
tests/deploy/data, and prometheus-adapter's rules against its config format."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from .k8s_objects import BUILDS, DATA, Docs, one

# The oldest Kubernetes the manifests promise to work on (topology spread's matchLabelKeys is on by default
# from 1.27) and the newest one kubernetes-validate ships schemas for.
K8S_VERSIONS = ("1.30", latest_version())

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.schema.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.schema.yaml",
}


def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / CRD_SCHEMAS[(api_version, kind)]).read_text(encoding="utf-8"))


def adapter_schema() -> dict[str, Any]:
    return yaml.safe_load((DATA / "prometheus-adapter-config.schema.yaml").read_text(encoding="utf-8"))


def validate(obj: dict[str, Any]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.validate(obj, crd_schema(*key), cls=jsonschema.Draft202012Validator)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def all_objects(built: dict[str, Docs]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, obj) for name in BUILDS for obj in built[name]]


def test_every_built_object_validates(built: dict[str, Docs]) -> None:
    failures = []
    for name, obj in all_objects(built):
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            where = "/".join(map(str, getattr(exc, "absolute_path", [])))
            failures.append(f"{name}: {obj['kind']}/{obj['metadata']['name']} {where}: "
                            f"{getattr(exc, 'message', exc)}")
    assert not failures, "\n".join(failures)


def test_strict_validation_rejects_an_unknown_field(built: dict[str, Docs]) -> None:
    # The checks above can fail: a misspelt field in a pod spec is refused, not ignored.
    deployment = copy.deepcopy(one(built["overlays/cpu"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(deployment)


@pytest.mark.parametrize("kind", ["ServiceMonitor", "ScaledObject"])
def test_crd_schemas_reject_unknown_and_missing_fields(built: dict[str, Docs], kind: str) -> None:
    obj = one(built["overlays/keda"], kind)
    validate(obj)
    misspelt = copy.deepcopy(obj)
    misspelt["spec"]["selectorr" if kind == "ServiceMonitor" else "minReplicas"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate(misspelt)
    missing = copy.deepcopy(obj)
    del missing["spec"]["selector" if kind == "ServiceMonitor" else "scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError):
        validate(missing)


def test_scaledobject_behavior_is_a_valid_hpa_behavior(built: dict[str, Docs]) -> None:
    # KEDA hands advanced.horizontalPodAutoscalerConfig.behavior to the HPA it creates: check it as one.
    scaled = one(built["overlays/keda"], "ScaledObject")["spec"]
    hpa = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda-hpa"},
        "spec": {"scaleTargetRef": scaled["scaleTargetRef"], "minReplicas": scaled["minReplicaCount"],
                 "maxReplicas": scaled["maxReplicaCount"],
                 "behavior": scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]},
    }
    validate(hpa)


def adapter_config(built: dict[str, Docs]) -> dict[str, Any]:
    return yaml.safe_load(one(built["prometheus-adapter"], "ConfigMap")["data"]["config.yaml"])


def test_prometheus_adapter_rules_follow_its_config_format(built: dict[str, Docs]) -> None:
    config = adapter_config(built)
    jsonschema.validate(config, adapter_schema(), cls=jsonschema.Draft202012Validator)
    for rule in config["rules"]:
        # Per-pod metrics: the HPA asks the adapter for pods, so every rule must map a label to the pod.
        assert "pod" in {o["resource"] for o in rule["resources"]["overrides"].values()}, rule["seriesQuery"]
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    broken = copy.deepcopy(config)
    del broken["rules"][0]["metricsQuery"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, adapter_schema(), cls=jsonschema.Draft202012Validator)
