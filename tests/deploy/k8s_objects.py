"""Reading deploy/k8s as built objects: the kubectl to build with, lookups, and the pod's environment."""

from __future__ import annotations

import os
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

from inferd import server

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DATA = Path(__file__).resolve().parent / "data"

# Every kustomization the tests build: the two overlays the issue asks for, the KEDA variant, and the
# prometheus-adapter rules.
BUILDS = ("overlays/cpu", "overlays/gpu", "overlays/keda", "prometheus-adapter")

# inferd's own bound on shutdown after the drain (issue 8): the whole shutdown finishes within
# server.drain_timeout_s plus this margin (the close of the connections left, and a watchdog at the margin).
# Taken from the server itself, so a longer margin there fails the grace-period check here.
SHUTDOWN_MARGIN_S: float = server.SHUTDOWN_MARGIN_S

INSTALL_HINT = (
    "no kubectl found to build deploy/k8s: set INFERD_KUBECTL to a kubectl binary or put one on PATH. "
    "On Debian: `apt-get install kubernetes-client`; if another package owns /usr/bin/kubectl, unpack "
    "Debian's instead: `apt-get download kubernetes-client && dpkg-deb -x kubernetes-client_*.deb "
    ".tools/kubernetes-client` and export INFERD_KUBECTL=$PWD/.tools/kubernetes-client/usr/bin/kubectl "
    "(.ci/run does this)."
)

Docs = list[dict[str, Any]]


def find_kubectl() -> str | None:
    explicit = os.environ.get("INFERD_KUBECTL")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("kubectl")


def kustomize(kubectl: str, folder: Path) -> subprocess.CompletedProcess[str]:
    # `kubectl kustomize DIR` exists in 1.20 too (and its embedded kustomize is the old one we keep to).
    return subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)


def objects(docs: Docs, kind: str) -> Docs:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: Docs, kind: str) -> dict[str, Any]:
    found = objects(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(docs: Docs, name: str = "inferd") -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in [*pod["containers"], *pod.get("initContainers", [])] if c["name"] == name)


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as a number ("700m" -> 0.7, "2" -> 2, "1Gi" -> 2**30)."""
    text = str(value)
    suffixes = {"m": "1e-3", "k": "1e3", "M": "1e6", "G": "1e9", "Ki": "1024", "Mi": "1048576", "Gi": "1073741824"}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            # Decimal, so "700m" is exactly 0.7 and compares equal to a threshold written as 0.7.
            return float(Decimal(text[: -len(suffix)]) * Decimal(suffixes[suffix]))
    return float(text)


PLACEHOLDER = "placeholder-{key}"


def resolve_env(docs: Docs, name: str = "inferd") -> dict[str, str]:
    """The environment the container would get: literal values, Secret keys as placeholders, resource fields
    computed from the container's own resources (rounded up, as the kubelet does with divisor 1)."""
    c = container(docs, name)
    env: dict[str, str] = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            env[var["name"]] = PLACEHOLDER.format(key=source["secretKeyRef"]["key"])
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, resource = ref["resource"].split(".", 1)
            raw = quantity(c["resources"][kind][resource]) / quantity(ref.get("divisor", "1"))
            env[var["name"]] = str(int(-(-raw // 1)))
        else:
            raise AssertionError(f"env {var['name']}: no resolver for {sorted(source)} in the tests")
    return env


def config_map_data(docs: Docs, prefix: str) -> dict[str, str]:
    """The data of the ConfigMap whose generated name starts with ``prefix`` (kustomize adds a hash)."""
    found = [d for d in objects(docs, "ConfigMap") if d["metadata"]["name"].startswith(prefix)]
    assert len(found) == 1, f"expected one ConfigMap {prefix}*, found {[d['metadata']['name'] for d in found]}"
    return found[0]["data"]
