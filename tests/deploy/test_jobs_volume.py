"""Batch jobs on Kubernetes (issue 42): every pod of every serving build sees one jobs folder (a ReadWriteMany
claim, mounted writable where jobs.data_dir points) and one PostgreSQL store (jobs.database_url from a Secret
that must exist: pods falling back to SQLite each would split the jobs between them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from inferd.config import load_settings

from .k8s_objects import Docs, container, objects, one, resolve_env

SERVING = ("overlays/cpu", "overlays/gpu", "overlays/keda")


def variable(docs: Docs, name: str) -> dict:
    found = [v for v in container(docs).get("env", []) if v["name"] == name]
    assert len(found) == 1, f"{name} is set {len(found)} times in the inferd container"
    return found[0]


@pytest.mark.parametrize("name", SERVING)
def test_the_jobs_folder_is_one_writable_volume_every_pod_shares(built: dict[str, Docs], name: str,
                                                                  pod_config_dir: Callable[[Docs], Path]) -> None:
    docs = built[name]
    env = resolve_env(docs)
    data_dir = str(load_settings(env.get("INFERD_ENV"), environ=env, config_dir=pod_config_dir(docs)).jobs.data_dir)
    mounts = [m for m in container(docs)["volumeMounts"]
              if f"{data_dir}/".startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"jobs.data_dir {data_dir} is under no volume: the read-only root would refuse it"
    assert not mounts[0].get("readOnly")
    volume = next(v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mounts[0]["name"])
    claim = next(p for p in objects(docs, "PersistentVolumeClaim")
                 if p["metadata"]["name"] == volume["persistentVolumeClaim"]["claimName"])
    # Any pod takes a job's next chunk and serves its files: all of them on all nodes must see the same folder.
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("name", SERVING)
def test_the_jobs_store_is_a_database_url_from_a_secret_that_must_exist(built: dict[str, Docs], name: str) -> None:
    source = variable(built[name], "INFERD__JOBS__DATABASE_URL").get("valueFrom", {})
    ref = source.get("secretKeyRef")
    assert ref, "the URL holds a password: it comes from a Secret, never a literal in the manifest"
    assert (ref["name"], ref["key"]) == ("inferd-jobs", "database-url")
    assert not ref.get("optional"), "without the Secret each pod would keep its own SQLite store"
    assert resolve_env(built[name]).get("INFERD__JOBS__ENABLED", "true") != "false"
