"""The pipeline phase of ``inferd bench``: its summary arithmetic, and one short real run (tiny models) of both
arrangements, one process serving both models and two single-model processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferd.bench.pipeline import ARRANGEMENTS, pipeline_markdown, summarise


def figures(embed: float, embed_p99: float, pairs: float, pairs_p99: float) -> dict[str, float]:
    return {"embed_texts_per_s": embed, "embed_p99_ms": embed_p99, "rerank_pairs_per_s": pairs,
            "rerank_p99_ms": pairs_p99}


def test_ratios_are_taken_within_a_round_and_spread_over_rounds() -> None:
    rounds = [{"round": 0, ARRANGEMENTS[0]: figures(100, 10, 300, 50), ARRANGEMENTS[1]: figures(50, 20, 200, 40)},
              {"round": 1, ARRANGEMENTS[1]: figures(40, 10, 100, 50), ARRANGEMENTS[0]: figures(60, 30, 400, 50)},
              {"round": 2, ARRANGEMENTS[0]: figures(90, 10, 300, 50)}]  # its other arrangement failed to start
    s = summarise(rounds)
    assert s["one / two"]["embed_texts_per_s"]["per_round"] == [2.0, 1.5]
    assert s["one / two"]["rerank_pairs_per_s"]["per_round"] == [1.5, 4.0]
    assert s["one / two"]["embed_p99_ms"] == {"per_round": [0.5, 3.0], "median": 1.75, "min": 0.5, "max": 3.0}
    assert s[ARRANGEMENTS[0]]["embed_texts_per_s"] == {"median": 90, "min": 60, "max": 100}
    assert s[ARRANGEMENTS[1]]["rerank_pairs_per_s"] == {"median": 150.0, "min": 100, "max": 200}


def test_a_short_run_serves_both_arrangements_and_every_request(tiny_model: Path,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    from tinymodel import write_tiny_cross_encoder

    from inferd.bench.run import main

    out = tmp_path_factory.mktemp("pipeline-bench")
    cross_encoder = write_tiny_cross_encoder(out / "ce", max_positions=128)
    rc = main(["--phases", "pipeline", "--model", str(tiny_model), "--rerank-model", str(cross_encoder),
               "--out", str(out), "--logs", str(out / "logs"), "--torch-threads", "2", "--duration", "0.7",
               "--warmup", "0", "--no-plot", "--pipeline-embed-concurrency", "2",
               "--pipeline-rerank-concurrency", "2"])
    results = json.loads((out / "results.json").read_text())
    phase = results["phases"]["pipeline"]
    assert rc == 0 and "error" not in phase, phase.get("error")
    (row,) = phase["rounds"]
    assert phase["threads_each_of_two"] == [1, 1] and phase["round_errors"] == []
    for name in ARRANGEMENTS:
        f = row[name]
        assert f["embed_texts_per_s"] > 0 and f["rerank_pairs_per_s"] > 0, (name, f)
        assert f["embed_errors"] == {} and f["rerank_errors"] == {}, (name, f)  # every request answered 200
    assert phase["summary"]["one / two"]["embed_texts_per_s"]["per_round"] == [
        round(row[ARRANGEMENTS[0]]["embed_texts_per_s"] / row[ARRANGEMENTS[1]]["embed_texts_per_s"], 3)]
    assert pipeline_markdown(phase) in (out / "RESULTS.md").read_text()
