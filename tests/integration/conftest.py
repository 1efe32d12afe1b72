"""The integration suites' shared task servers: one tiny cross-encoder and one tiny classifier, each served once
for the whole package (test_tasks, test_tei_api, test_many_models's references, and any suite that only
asks them questions).

A test that changes one (a reload) puts it back before it ends; one that needs other settings starts its own
(conftest's ``serve`` or ``module_serve``). Their folders lie in ``task_models``, beside which a suite may write
other models the servers may be reloaded to (the servers' model root is that folder).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Server, running
from tinymodel import write_tiny_classifier, write_tiny_cross_encoder

ADMIN_KEY = "admin-secret"


@pytest.fixture(scope="package")
def task_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("task-models")
    write_tiny_cross_encoder(root / "ce", seed=3)
    write_tiny_cross_encoder(root / "ce2", seed=4)  # what a reload of the reranker switches to
    write_tiny_classifier(root / "cls", seed=5)
    return root


def task_env(path: Path, **env: str) -> dict[str, str]:
    """A task server's settings: loaded before ready, admin routes on its port, no result cache (every answer
    is computed, as the reference comparisons need)."""
    return {"INFERD__MODEL__PATH": str(path), "INFERD__MODEL__LOAD_MODE": "eager", "INFERD__SERVER__ADMIN_KEY":
            ADMIN_KEY, "INFERD__CACHE__MAX_ENTRIES": "0", **env}


@pytest.fixture(scope="package")
def reranker(task_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("reranker"), task_env(task_models / "ce"), wait="/health/ready") as server:
        yield server


@pytest.fixture(scope="package")
def classifier(task_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("classifier"), task_env(task_models / "cls"),
                 wait="/health/ready") as server:
        yield server
