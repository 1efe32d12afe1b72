"""The backends phase's own logic: configuration strings, ratios within rounds, the table."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.bench.backends import Config, parse_configs
from inferd.bench.backends_report import render, summarise
from inferd.bench.run import build_parser


def test_configurations_parse_in_any_order() -> None:
    assert parse_configs("torch, openvino:bfloat16 ,onnx:int8,openvino:int8:bfloat16") == [
        Config("torch"), Config("openvino", "bfloat16"), Config("onnx", quantize="int8"),
        Config("openvino", "bfloat16", "int8")]
    assert Config("openvino", "bfloat16", "int8").name == "openvino bf16 int8"
    assert Config("torch").name == "torch fp32"
    assert parse_configs("torch:padded:bfloat16") == [Config("torch", "bfloat16", padded=True)]
    assert Config("torch", padded=True).name == "torch fp32 padded"
    assert Config("torch", padded=True).env(Path("/c"))["INFERD__MODEL__UNPADDED"] == "false"
    assert "INFERD__MODEL__UNPADDED" not in Config("torch").env(Path("/c"))


@pytest.mark.parametrize(("spec", "words"), [
    ("tensorrt", "backend must be one of"),
    ("openvino:int4", "at most one dtype"),
    ("openvino:padded", "at most one dtype"),
    ("torch:padded:padded", "at most one dtype"),
    ("openvino:bfloat16:float32", "at most one dtype"),
    (" , ", "no backend configuration"),
])
def test_bad_configurations_are_refused(spec: str, words: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        parse_configs(spec)


def test_the_bench_parser_takes_the_backend_flags() -> None:
    args = build_parser().parse_args(["--phases", "backends", "--backend", "torch,openvino:int8",
                                      "--backend-rounds", "2", "--infinity", "/x/infinity_emb"])
    assert args.backend == [Config("torch"), Config("openvino", quantize="int8")]
    assert args.backend_rounds == 2 and str(args.infinity) == "/x/infinity_emb"


def test_config_environment_points_a_server_at_the_cache(tmp_path) -> None:
    env = Config("onnx", quantize="int8").env(tmp_path)
    assert env == {"INFERD__MODEL__BACKEND": "onnx", "INFERD__MODEL__DTYPE": "float32",
                   "INFERD__MODEL__QUANTIZE": "int8", "INFERD__MODEL__CACHE_DIR": str(tmp_path)}


def test_ratios_are_taken_within_each_round() -> None:
    # The machine got twice as slow in round 1: the ratio stays 2 although the raw figures halve.
    rows = {"torch fp32": {"rounds": [{"round": 0, "server": 100.0}, {"round": 1, "server": 50.0}]},
            "openvino bf16": {"rounds": [{"round": 0, "server": 200.0}, {"round": 1, "server": 100.0}]},
            "infinity torch": {"rounds": [{"round": 1, "server": 25.0}]}}
    out = summarise(rows, "torch fp32", "sentence-transformers")["rows"]
    assert out["openvino bf16"]["server"] == {"median": 150.0, "min": 100.0, "max": 200.0}
    assert out["openvino bf16"]["server_ratio"] == {"median": 2.0, "min": 2.0, "max": 2.0}
    assert out["infinity torch"]["server_ratio"]["median"] == 0.5
    assert out["torch fp32"]["in_process"]["median"] is None


def test_each_server_is_judged_against_its_own_ceiling_of_the_same_round() -> None:
    # Round 1's machine is slower for both: the share of the ceiling holds although both figures fell.
    rows = {"openvino bf16": {"rounds": [{"round": 0, "in_process": 200.0, "server": 180.0},
                                         {"round": 1, "in_process": 100.0, "server": 80.0},
                                         {"round": 2, "server": 150.0}]}}
    out = summarise(rows, "openvino bf16", "st")["rows"]["openvino bf16"]
    assert out["of_ceiling"] == {"median": 0.85, "min": 0.8, "max": 0.9}  # round 2 had no ceiling: not judged


def test_the_in_process_ceiling_runs_whole_passes_for_its_window() -> None:
    from inferd.bench.backends import in_process

    class Counting:
        def __init__(self) -> None:
            self.texts = 0

        def preprocess(self, texts: list[str]) -> list[Any]:
            self.texts += len(texts)
            return [SimpleNamespace(tokens=len(t)) for t in texts]

        def infer(self, batch: list[Any]) -> list[Any]:
            time.sleep(0.01)
            return batch

        def postprocess(self, outputs: list[Any]) -> list[Any]:
            return outputs

    once, windowed = Counting(), Counting()
    in_process(once, ["a", "bb", "ccc"], batch_size=2)
    in_process(windowed, ["a", "bb", "ccc"], batch_size=2, min_seconds=0.2)
    assert once.texts == 3  # one pass
    assert windowed.texts >= 6 and windowed.texts % 3 == 0  # whole passes (of 0.02 s each), for the window


def test_the_table_shows_figures_and_refusals() -> None:
    rows = {"torch fp32": {"rounds": [{"round": 0, "server": 100.0, "in_process": 130.0, "warm_start_s": 4.0}],
                           "accuracy": {"cosine_min": 0.99991, "cosine_mean": 1.0, "overlap_at_10": 1.0},
                           "cold_start_s": 6.1},
            "onnx fp32 int8": {"rounds": [], "error": "inferd exited with 3:\nBackendError: onnx float32 int8 "
                                                      "refused by the accuracy gate (int8 thresholds): cosine "
                                                      "min 0.82 < 0.99 (model.gate.int8_cosine_min)"}}
    text = render(summarise(rows, "torch fp32", "sentence-transformers"), 1, 15)
    assert "| torch fp32 | 130.0 (130.0–130.0) | 1.00 (1.00–1.00) | 100.0 (100.0–100.0) | 1.00 (1.00–1.00) | 0.77 " \
           "(0.77–0.77) |" in text
    assert "0.99991 / 1.00000 | 1.000 | 6.1 | 4.0 (4.0–4.0) |" in text
    assert "| onnx fp32 int8 | **refused by the gate** (int8 thresholds): cosine min 0.82 < 0.99" in text
    assert "against sentence-transformers" in text


def test_a_refusal_in_a_json_log_line_shows_just_the_verdict() -> None:
    from inferd.bench.backends import why_failed

    tail = ('inferd exited with 3:\n{"time":"t","level":"ERROR","message":"model load failed: openvino float32 int8 '
            'refused by the accuracy gate (int8 thresholds): overlap@10 0.940600 < 0.95 '
            '(model.gate.int8_overlap_at_10). Figures ...","module":"manager"}\n{"level":"CRITICAL"}')
    assert why_failed(tail) == ("**refused by the gate** (int8 thresholds): overlap@10 0.940600 < 0.95 "
                          "(model.gate.int8_overlap_at_10). Figures ...")
    assert why_failed("Traceback\nValueError: No onnx files found") == "failed: ValueError: No onnx files found"


def test_without_a_bf16_row_the_int8_configurations_stand_in_and_a_refused_one_fails() -> None:
    refusal = ('{"message":"model load failed: openvino fp32 int8 refused by the accuracy gate (int8 thresholds): '
               'cosine min 0.985719 < 0.99 (model.gate.int8_cosine_min)","module":"x"}')
    rows = {"torch fp32": {"rounds": [{"round": 0, "server": 50.0}, {"round": 1, "server": 40.0}]},
            "openvino fp32 int8-weights": {"rounds": [{"round": 0, "server": 60.0}, {"round": 1, "server": 52.0}],
                                           "accuracy": {"cosine_min": 0.998, "cosine_mean": 0.9994,
                                                        "overlap_at_10": 0.969}},
            "openvino fp32 int8": {"rounds": [], "error": refusal},
            "infinity torch": {"rounds": [{"round": 0, "server": 25.0}, {"round": 1, "server": 20.0}]}}
    found = {(t["config"], t["versus"], t["wanted"]): t for t in summarise(rows, "torch fp32", "st")["targets"]}
    weights = found[("openvino fp32 int8-weights", "torch fp32", 1.8)]
    assert weights["rounds"] == [1.2, 1.3] and not weights["met"]
    assert "bf16: this CPU has none native" in weights["note"]
    assert found[("openvino fp32 int8-weights", "infinity torch", 3.0)]["rounds"] == [2.4, 2.6]
    refused = found[("openvino fp32 int8", "torch fp32", 2.5)]
    assert refused["median"] is None and not refused["met"] and "refused by the gate" in refused["note"]
    assert ("openvino fp32 int8", "infinity optimum", 1.2) not in found  # infinity optimum did not run
    text = render(summarise(rows, "torch fp32", "st"), 2, 15)
    assert "| openvino fp32 int8 (**refused by the gate** (int8 thresholds)) | torch fp32 | ≥ 2.5 | – | – |" in text


def by_pair(section: dict) -> dict:
    return {(t["config"], t["versus"]): t for t in section["targets"]}


def test_targets_are_judged_on_ratios_within_rounds() -> None:
    # openvino bf16 over infinity torch: 3.2 and 2.9 in the two rounds both engines ran; round 2 has no infinity.
    rows = {"torch fp32": {"rounds": [{"round": 0, "server": 50.0}, {"round": 1, "server": 40.0},
                                      {"round": 2, "server": 60.0}]},
            "openvino bf16": {"rounds": [{"round": 0, "server": 96.0}, {"round": 1, "server": 58.0},
                                         {"round": 2, "server": 120.0}],
                              "accuracy": {"cosine_min": 0.9999, "cosine_mean": 0.99998, "overlap_at_10": 0.993}},
            "infinity torch": {"rounds": [{"round": 0, "server": 30.0}, {"round": 1, "server": 20.0}]}}
    section = summarise(rows, "torch fp32", "sentence-transformers")
    by = by_pair(section)
    assert by[("openvino bf16", "infinity torch")]["rounds"] == [3.2, 2.9]
    assert by[("openvino bf16", "infinity torch")]["median"] == pytest.approx(3.05)
    assert by[("openvino bf16", "infinity torch")]["met"]
    assert by[("openvino bf16", "torch fp32")]["rounds"] == [1.92, 1.45, 2.0]
    assert by[("openvino bf16", "torch fp32")]["met"]  # median 1.92 >= 1.8
    assert ("openvino fp32 int8", "torch fp32") not in by  # not measured: no row, no verdict
    assert ("openvino bf16 int8", "torch fp32") not in by
    assert section["rows"]["openvino bf16"]["versus"] == {"infinity torch": [3.2, 2.9]}
    text = render(section, 3, 15)
    assert "| openvino bf16 | infinity torch | ≥ 3 | 3.05 | 3.20, 2.90 | 0.99998 | 0.993 | yes |" in text
    rows["openvino bf16 int8"] = {"rounds": [{"round": 0, "server": 130.0}, {"round": 1, "server": 100.0}]}
    assert by_pair(summarise(rows, "torch fp32", "st"))[("openvino bf16 int8", "torch fp32")]["rounds"] == [2.6, 2.5]
    rows["openvino bf16"]["rounds"][2]["server"] = 90.0  # 1.92, 1.45, 1.5: median 1.5 < 1.8
    assert not next(t for t in summarise(rows, "torch fp32", "st")["targets"] if t["versus"] == "torch fp32")["met"]


def test_rerank_summary_takes_ratios_within_rounds_and_judges_the_targets() -> None:
    from inferd.bench.report import rerank_backends_table
    from inferd.bench.rerank import summarise

    def rounds(*values: float) -> list[dict]:
        return [{"round": r, "pairs_per_s": v, "p99_ms": 100.0} for r, v in enumerate(values)]

    rows = {"torch fp32": {"rounds": rounds(100, 50, 80)}, "openvino bf16": {"rounds": rounds(250, 90, 200)},
            "openvino fp32 int8": {"rounds": [], "error": "**refused by the gate** (int8 thresholds): Spearman"},
            "infinity torch": {"rounds": rounds(50, 40, 60)}}
    out = summarise(rows, "torch fp32")
    bf16 = out["rows"]["openvino bf16"]
    # Round by round (2.5, 1.8, 2.5), not the ratio of medians (200 / 80).
    assert bf16["ratio"] == {"median": 2.5, "min": 1.8, "max": 2.5}
    assert bf16["versus"]["infinity torch"] == [5.0, 2.25, 3.333]
    targets = {(t["configuration"], t["versus"]): t for t in out["targets"]}
    assert targets["openvino bf16", "torch fp32"]["met"] is True
    assert targets["openvino bf16", "infinity torch"]["median"] == 3.333
    table = "\n".join(rerank_backends_table(out))
    assert "| openvino fp32 int8 | **refused by the gate**" in table
    assert "| openvino bf16 / infinity torch | 3.0 |" in table
