"""Fixtures for the deploy/ checks: a kubectl to build the kustomize tree with, and the built objects.

CI (.ci/run) installs Debian's kubernetes-client, whose kubectl 1.20 embeds an old kustomize, and points
INFERD_KUBECTL at it when another package's kubectl owns /usr/bin/kubectl; so the manifests are built with
the oldest kustomize they promise to support. Without INFERD_KUBECTL, `kubectl` on PATH builds them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from .k8s_objects import BUILDS, INSTALL_HINT, K8S, ROOT, Docs, config_map_data, find_kubectl, kustomize


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = find_kubectl()
    if path is None:
        # A failure, not a skip: without it nothing in deploy/k8s is checked, and CI must say so.
        pytest.fail(INSTALL_HINT + f" (INFERD_KUBECTL={os.environ.get('INFERD_KUBECTL')!r})", pytrace=False)
    return path


@pytest.fixture(scope="session")
def built(kubectl: str) -> dict[str, Docs]:
    """The objects each kustomization builds to, by its path under deploy/k8s."""
    out: dict[str, Docs] = {}
    for name in BUILDS:
        result = kustomize(kubectl, K8S / name)
        assert result.returncode == 0, f"{kubectl} kustomize deploy/k8s/{name} failed:\n{result.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


@pytest.fixture
def pod_config_dir(tmp_path: Path) -> Callable[[Docs], Path]:
    """A configs folder as the pod sees it: the image's base.yaml and the ConfigMap's prod.yaml."""

    def make(docs: Docs) -> Path:
        folder = tmp_path / "configs"
        folder.mkdir(exist_ok=True)
        shutil.copy(ROOT / "configs" / "base.yaml", folder / "base.yaml")
        (folder / "prod.yaml").write_text(config_map_data(docs, "inferd-config")["prod.yaml"], encoding="utf-8")
        return folder

    return make
