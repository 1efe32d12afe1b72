"""The pods start warm: an ``inferd prepare`` init container fills a cache volume every pod shares, with the serving
container's own model settings (a setting that differs keys another cache entry, and the server would judge again),
checked against inferd's own settings loading, offline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from inferd.config import load_settings
from inferd.settings import ModelSettings

from .k8s_objects import Docs, container, objects, one, resolve_env

SERVING = ("overlays/cpu", "overlays/gpu", "overlays/keda")
# What a cache entry and backend auto's choice depend on (core/backends/factory.py entry_key, auto.py candidates).
CACHE_KEYED = ("path", "backend", "dtype", "quantize", "device", "auto_candidates", "cache_dir", "calibration_file",
               "gate", "max_seq_length", "pooling", "task")


def model_settings(docs: Docs, name: str, config_dir: Path) -> ModelSettings:
    env = resolve_env(docs, name)
    env["INFERD_CONFIG_DIR"] = str(config_dir)
    return load_settings(env.get("INFERD_ENV"), environ=env, config_dir=config_dir).model


def pod(docs: Docs) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", SERVING)
def test_prepare_runs_before_inferd_with_the_servers_own_model_settings(
        built: dict[str, Docs], name: str, pod_config_dir: Callable[[Docs], Path]) -> None:
    docs = built[name]
    spec = pod(docs)
    assert [c["name"] for c in spec["initContainers"]] == ["prepare"]
    prepare, serve = container(docs, "prepare"), container(docs, "inferd")
    assert prepare["command"] == ["inferd", "prepare"] and prepare["image"] == serve["image"]
    configs = pod_config_dir(docs)
    wanted, got = model_settings(docs, "inferd", configs), model_settings(docs, "prepare", configs)
    for key in CACHE_KEYED:
        assert getattr(got, key) == getattr(wanted, key), f"{name}: prepare's model.{key} is not the server's"
    assert wanted.backend == "auto", "the production default is backend auto (configs/prod.yaml)"


@pytest.mark.parametrize("name", SERVING)
def test_the_cache_is_one_shared_writable_volume_at_model_cache_dir(
        built: dict[str, Docs], name: str, pod_config_dir: Callable[[Docs], Path]) -> None:
    docs = built[name]
    volumes = {v["name"]: v for v in pod(docs)["volumes"]}
    cache_dir = model_settings(docs, "inferd", pod_config_dir(docs)).cache_dir
    assert cache_dir, "without model.cache_dir the cache is under the read-only root filesystem's home"
    claims = {p["metadata"]["name"]: p for p in objects(docs, "PersistentVolumeClaim")}
    for c in (container(docs, "prepare"), container(docs, "inferd")):
        mounts = [m for m in c["volumeMounts"] if f"{cache_dir}/".startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1 and not mounts[0].get("readOnly"), f"{c['name']}: {cache_dir} is not writable"
        claim = volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"]
        # Every pod, on any node, reads and writes the same entries: one claim, ReadWriteMany.
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("name", SERVING)
def test_prepare_is_locked_down_and_sized_like_the_server(built: dict[str, Docs], name: str) -> None:
    prepare, serve = container(built[name], "prepare"), container(built[name], "inferd")
    sc = prepare["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
    # On a CPU it loads and exports the model: the server's memory. On a GPU the choice is torch float16, nothing to
    # export: it loads nothing and needs no GPU.
    if name != "overlays/gpu":
        assert prepare["resources"]["limits"]["memory"] == serve["resources"]["limits"]["memory"]
    assert "nvidia.com/gpu" not in prepare["resources"]["limits"]
    models = next(m for m in prepare["volumeMounts"] if m["mountPath"] == "/models")
    assert models["readOnly"] is True
