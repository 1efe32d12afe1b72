"""deploy/k8s builds with kubectl's kustomize, stays within what the oldest supported kustomize understands,
and its copies of configs/prod.yaml and the Grafana dashboard are the originals."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from settingskit import make_settings

from .k8s_objects import BUILDS, K8S, ROOT, Docs, config_map_data, kustomize, objects

# What the kustomize embedded in Debian's kubectl 1.20 (kustomize v2.0.3 era) reads. Newer fields (`patches`
# with targets, `labels`, `components`, `replacements`, ...) would build with a current kubectl and fail there.
OLD_KUSTOMIZE_FIELDS = {
    "apiVersion", "kind", "resources", "bases", "patchesStrategicMerge", "configMapGenerator",
    "generatorOptions", "images", "namespace", "commonLabels",
}


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def test_kubectl_reports_its_version(kubectl: str) -> None:
    out = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "v1." in out.stdout, out.stdout


@pytest.mark.parametrize("name", BUILDS)
def test_each_kustomization_builds(kubectl: str, name: str) -> None:
    result = kustomize(kubectl, K8S / name)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert docs and all(d.get("kind") and d.get("metadata", {}).get("name") for d in docs)


def test_every_kustomization_is_built_by_the_tests() -> None:
    # A new overlay that no test builds would escape every check below.
    leaves = {p.parent.relative_to(K8S).as_posix() for p in kustomizations()}
    bases = {"base", "base/dashboard"}
    assert leaves - bases == set(BUILDS)


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: p.parent.relative_to(K8S).as_posix())
def test_kustomization_uses_only_what_the_old_kustomize_knows(path: Path) -> None:
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert set(spec) <= OLD_KUSTOMIZE_FIELDS, f"not understood by kubectl 1.20: {set(spec) - OLD_KUSTOMIZE_FIELDS}"
    # Old kustomize takes files under `resources` and directories under `bases`, never the other way round.
    for entry in spec.get("resources", []):
        assert (path.parent / entry).is_file(), f"resources entry {entry!r} must be a file (folders go in bases)"
    for entry in spec.get("bases", []):
        assert (path.parent / entry / "kustomization.yaml").is_file(), f"bases entry {entry!r} is no kustomization"
    for entry in spec.get("patchesStrategicMerge", []):
        assert isinstance(entry, str) and (path.parent / entry).is_file(), "patches must be files"


@pytest.mark.parametrize("file", ["prod.yaml", "pipeline.yaml"])
def test_config_map_holds_configs_overlays(built: dict[str, Docs], file: str) -> None:
    original = (ROOT / "configs" / file).read_text(encoding="utf-8")
    for name in ("overlays/cpu", "overlays/gpu", "overlays/keda"):
        assert config_map_data(built[name], "inferd-config")[file] == original, (
            f"deploy/k8s/base/{file} differs from configs/{file}: copy it (kustomize reads only files "
            "inside its own folder)")


def test_the_pipeline_overlay_serves_three_models_of_three_tasks(built: dict[str, Docs], tmp_path: Path) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "base.yaml").write_text((ROOT / "configs" / "base.yaml").read_text(encoding="utf-8"))
    (folder / "pipeline.yaml").write_text(config_map_data(built["overlays/cpu"], "inferd-config")["pipeline.yaml"])
    served = make_settings(layered="pipeline", config_dir=folder).served()
    assert [(m.name, m.model.task, m.required) for m in served] == [
        ("embedder", "auto", True), ("reranker", "rerank", True), ("classifier", "classification", False)]
    assert served[1].batching.max_batch_size == 64 and served[0].batching.max_batch_size == 32
    assert all(m.model.load_mode == "background" for m in served)  # the model: block is every entry's default


def test_dashboard_config_map_is_the_grafana_dashboard(built: dict[str, Docs]) -> None:
    original = (ROOT / "deploy" / "grafana" / "inferd.json").read_text(encoding="utf-8")
    dashboards = [d for d in objects(built["overlays/cpu"], "ConfigMap") if d["metadata"]["name"] == "inferd-dashboard"]
    assert len(dashboards) == 1
    assert dashboards[0]["data"]["inferd.json"] == original, "copy deploy/grafana/inferd.json to base/dashboard/"
    assert dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_overlays_put_everything_in_one_namespace(built: dict[str, Docs]) -> None:
    for name in ("overlays/cpu", "overlays/gpu", "overlays/keda"):
        assert {d["metadata"].get("namespace") for d in built[name]} == {"inferd"}, name
