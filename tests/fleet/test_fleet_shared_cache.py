"""A fleet's two workers start with backend auto on one cold cache: both serve torch at once, both judge the same
candidate, and the model is exported once (the cache entry's lock: core/backends/cache_entries.py ``entry_lock``); the
worker that waited reads the other's entry and both end on it."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import wait_for

from .fleetkit import finish, requires_nginx, start_fleet

pytestmark = requires_nginx

FP32 = "openvino-float32"


def test_two_workers_on_one_cold_cache_export_the_model_once(tiny_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fleet = start_fleet(tmp_path, tiny_model, {
        "INFERD__MODEL__BACKEND": "auto", "INFERD__MODEL__AUTO_CANDIDATES": f'["{FP32}"]',
        "INFERD__MODEL__CACHE_DIR": str(cache), "INFERD__MODEL__GATE__TEXTS": "32"})
    try:
        ports = [w["port"] for w in fleet.workers]

        def auto_of(port: int) -> dict:
            return httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()["auto"]

        for port in ports:
            done = wait_for(lambda port=port: (a := auto_of(port))["state"] == "done" and a, timeout=240,
                            what=f"worker on {port} judging", every=0.5)
            assert done["serving"] == FP32, done
        logs = [fleet.log(w["name"]) for w in fleet.workers]
        exported = [log.count(f"exporting {tiny_model}") for log in logs]
        assert sorted(exported) == [0, 1], exported
        # One entry, one export of the model beside it (every dtype's: factory.shared_export), lock files aside.
        entries = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
        assert len(entries) == 2 and sum((p / "meta.json").is_file() for p in entries) == 1
        assert sum(p.name.startswith("export-") for p in entries) == 1
        # Through nginx, either worker answers from the one entry.
        r = httpx.post(fleet.url + "/v1/embeddings", json={"input": ["hello"]}, timeout=30)
        assert r.status_code == 200 and r.headers["x-inferd-runtime"] == FP32
    finally:
        finish(fleet)
