"""``inferd prepare`` as an init container or a Job runs it: real processes on the tiny BERT, its exit codes, and two
of them started at once on one cold cache (a fleet's workers, or pods on a shared volume) exporting the model once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import ROOT

from inferd import cli

# One candidate keeps each export and gate to seconds; the gate on 32 texts.
FP32 = "openvino-float32"


def prepare_env(model: Path, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERD")}
    env.update({"INFERD_ENV": "dev", "INFERD_CONFIG_DIR": str(ROOT / "configs"), "MODEL_PATH": str(model),
                "INFERD__MODEL__BACKEND": "auto", "INFERD__MODEL__CACHE_DIR": str(cache),
                "INFERD__MODEL__AUTO_CANDIDATES": f'["{FP32}"]', "INFERD__MODEL__GATE__TEXTS": "32",
                "INFERD__RUNTIME__TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra})
    return env


def start(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "inferd.cli", "prepare"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=240)
    # The report is the last thing on stdout (a library may print before it).
    start = out.rfind("\n{\n") + 1 if not out.startswith("{") else 0
    return proc.returncode, (json.loads(out[start:]) if "{" in out else {}), err


def test_two_prepares_on_one_cold_cache_export_once_and_both_say_ready(tiny_model: Path, tmp_path: Path) -> None:
    # A second candidate ranked after the one that passes: not judged, and said so in the report as in the choice.
    env = prepare_env(tiny_model, tmp_path / "cache", INFERD__MODEL__AUTO_CANDIDATES=f'["{FP32}", "openvino-bfloat16"]')
    first, second = start(env), start(env)
    results = [finish(first), finish(second)]
    for code, out, err in results:
        assert code == 0, (out.get("candidates"), err[-3000:])
        assert out["ready"] and out["serves"] == FP32 and out["candidates"][FP32]["state"] == "passed"
    # One built the entry; the other waited on its lock and read it: one miss, one hit, one entry on disk.
    assert sorted(out["candidates"][FP32]["cache"] for _, out, _ in results) == ["hit", "miss"]
    entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and not p.name.startswith((".", "export-"))]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()
    assert results[0][1]["candidates"][FP32]["cache_entry"] == results[1][1]["candidates"][FP32]["cache_entry"]
    # The choice is kept for a server with the same settings to start on at once (core/backends/auto.py).
    kept = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("auto-*.json")]
    # The entry is named from the cache's root, so the cache may be mounted elsewhere.
    assert [(k["candidate"], k["entry"]) for k in kept] == [(FP32, entries[0].name)]
    assert results[0][1]["candidates"][FP32]["cache_entry"] == str(entries[0])
    # With the verdicts on the others (a warm start's /info says why they do not serve), each with its reason.
    others = {v["candidate"]: v for v in kept[0]["others"]}
    assert FP32 not in others and others and all(v["reason"] for v in others.values())
    assert {n: (v["state"], v["reason"]) for n, v in others.items()} == {
        n: (v["state"], v["reason"]) for n, v in results[0][1]["candidates"].items() if n != FP32}
    assert others["openvino-bfloat16"]["state"] == "skipped"


def test_prepare_fails_when_the_cache_cannot_be_written_and_refuses_an_unknown_candidate(
        tiny_model: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    code, out, err = finish(start(prepare_env(tiny_model, blocked / "cache")))
    assert code == 1 and not out["ready"] and out["candidates"][FP32]["state"] == "failed"
    assert "not writable" in out["candidates"][FP32]["reason"]
    code, out, err = finish(start(prepare_env(tiny_model, tmp_path / "cache",
                                              INFERD__MODEL__AUTO_CANDIDATES='["openvino-float64"]')))
    assert code == 2 and "model.auto_candidates.0: Input should be 'openvino-mixed'" in err


def test_export_refuses_backend_auto_naming_prepare(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("INFERD")]:
        monkeypatch.delenv(name)
    assert cli.main(["export", "--backend", "auto"]) == 2
    assert "inferd prepare" in capsys.readouterr().err

