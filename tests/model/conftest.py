"""Shared by the MiniLM model tests: one export cache for the whole run, and the gate settings its entries are
built under, so a configuration exported by one module (OpenVINO static int8, say) is a cache hit in the next."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The gate's set for the MiniLM exports: smaller than the default 256 texts (the gate's cost is in the export),
# large enough for overlap@10 to mean something.
MINILM_GATE = (("texts", 128),)


@pytest.fixture(scope="session")
def minilm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's export cache. Under pytest-xdist (``make test``) each worker process has a temporary folder of
    its own inside the run's: the cache lies in the run's, so a module on one worker finds what a module on the
    other exported (one that asks while the other exports waits on the cache entry's lock, then reads it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "minilm-backends"
    folder.mkdir(exist_ok=True)
    return folder
