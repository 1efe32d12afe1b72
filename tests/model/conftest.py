"""Shared by the MiniLM model tests: one export cache for the whole run, and the gate settings its entries are
built under, so a configuration exported by one module (OpenVINO static int8, say) is a cache hit in the next."""

from __future__ import annotations

from pathlib import Path

import pytest

# The gate's set for the MiniLM exports: smaller than the default 256 texts (the gate's cost is in the export),
# large enough for overlap@10 to mean something.
MINILM_GATE = (("texts", 128),)


@pytest.fixture(scope="session")
def minilm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("minilm-backends")
