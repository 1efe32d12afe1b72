"""The fleet phase of ``inferd bench``, very short, on the tiny model: what it measures, not how fast it is."""

from __future__ import annotations

import json
import socket
import statistics
from pathlib import Path

import pytest

from .fleetkit import requires_nginx

pytestmark = requires_nginx
C = 4


def test_fleet_phase_measures_one_and_two_workers_against_one_process(tiny_model: Path, tmp_path: Path) -> None:
    from inferd.bench.run import main

    out = tmp_path / "bench"
    rc = main(["--quick", "--phases", "fleet", "--model", str(tiny_model), "--out", str(out), "--logs",
               str(out / "logs"), "--torch-threads", "2", "--duration", "0.5", "--warmup", "0.1", "--no-plot",
               "--fleet-concurrency", str(C)])
    results = json.loads((out / "results.json").read_text())
    phases = results["phases"]
    assert rc == 0, {n: p.get("error") for n, p in phases.items()}
    assert set(phases) == {"fleet:direct@1", "fleet:nginx@1", f"fleet:plain@{C}", f"fleet:fleet1@{C}",
                           f"fleet:fleet2@{C}"}
    for name, p in phases.items():
        assert p["errors"] == {} and p["texts"] > 0, name
        assert p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"], name
    assert [(phases[n]["workers"], phases[n]["torch_threads"], phases[n]["via"])
            for n in ("fleet:plain@4", "fleet:fleet1@4", "fleet:fleet2@4")] == \
        [(1, 2, "direct"), (1, 2, "nginx"), (2, 1, "nginx")]  # the threads are split between two workers
    # Straight to a worker its /metrics gives batch figures; through nginx there are none to read (404).
    assert phases["fleet:plain@4"]["mean_batch_size"] >= 1 and phases["fleet:fleet2@4"]["mean_batch_size"] is None
    summary = results["fleet"]
    assert summary["fleet2_over_plain"] == pytest.approx(
        phases["fleet:fleet2@4"]["texts_per_s"] / phases["fleet:plain@4"]["texts_per_s"], rel=1e-2)
    # Every phase ran in turns; each ratio is also given turn by turn.
    assert all(p["slices"] == 4 and len(p["slice_texts_per_s"]) == 4 for p in phases.values())
    per_turn = phases["fleet:nginx@1"]["round_overhead_ms"]  # nginx − direct, P50 of the same turn
    assert per_turn == [round(n - d, 3) for n, d in zip(phases["fleet:nginx@1"]["slice_p50_ms"],
                                                          phases["fleet:direct@1"]["slice_p50_ms"], strict=True)]
    assert summary["nginx_overhead_p50_ms"] == pytest.approx(statistics.median(per_turn), abs=1e-3)
    assert summary["nginx_overhead_rounds_ms"] == [min(per_turn), max(per_turn)]
    turns = phases["fleet:fleet2@4"]["round_over_plain"]
    assert summary["fleet2_over_plain_rounds"] == [min(turns), max(turns)] and len(turns) == 4
    md = (out / "RESULTS.md").read_text()
    assert "## Fleet: nginx + supervisord" in md and "| fleet2@4 | 2 | 1 | nginx |" in md and "mean batch" in md
    # Both fleets were stopped: none of their ports still listens.
    for kept in {p["logs"] for p in phases.values()}:  # each fleet's run folder, copied beside the other logs
        assert (Path(kept) / "logs" / "worker-0.log").is_file()
        meta = json.loads((Path(kept) / "layout.json").read_text())
        ports = [meta["listen"]["port"], *(w["port"] for w in meta["workers"])]
        for port in ports:
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, port
