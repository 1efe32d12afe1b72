"""``inferd prepare``'s walk over backend auto's candidates, without a model: what a refusal settles for the candidates
after it, where a failure stops it, and the configurations refused before any (the judge faked;
tests/integration/test_prepare.py runs the real one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from inferd import prepare as prepare_module
from inferd.core.backends.gate_verdict import LESS_PRECISE
from inferd.core.spec import ModelSpec
from inferd.settings import Settings

AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni"}


def test_prepare_does_not_judge_plain_bf16_after_mixed_was_refused_as_less_precise(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    judged: list[str] = []

    def judge(spec: Any, runtime: dict[str, str]) -> dict[str, Any]:
        judged.append(runtime["dtype"] + ("-int8" if runtime["quantize"] == "int8" else ""))
        if runtime["dtype"] == "mixed":
            return {"state": "refused", "reason": f"refused by the accuracy gate: {LESS_PRECISE}: ...", "seconds": 1}
        return {"state": "passed", "seconds": 1, "cache_entry": None}

    monkeypatch.setattr(prepare_module, "judge", judge)
    monkeypatch.setattr(prepare_module, "cpu_flags", lambda: AMX)
    monkeypatch.setattr(prepare_module, "remember", lambda *a: None)
    monkeypatch.setattr("inferd.core.backends.auto.util.find_spec", lambda name: object())
    base = Settings()
    settings = base.model_copy(update={"model": base.model.model_copy(update={"backend": "auto", "device": "cpu"})})
    assert prepare_module.prepare(settings) == 0
    out = json.loads(capsys.readouterr().out)
    assert judged == ["mixed", "float32-int8"]
    assert out["serves"] == "openvino-float32-int8"
    assert out["candidates"]["openvino-bfloat16"]["state"] == "skipped"
    assert LESS_PRECISE in out["candidates"]["openvino-bfloat16"]["reason"]


def auto_settings(**model: Any) -> Settings:
    base = Settings()
    return base.model_copy(update={"model": base.model.model_copy(update={"backend": "auto", "device": "cpu",
                                                                          **model})})


@pytest.mark.parametrize(("backend", "dtype", "quantize", "words"), [
    ("openvino", "float16", "none", "model.dtype float16 is for CUDA"),
    ("onnx", "mixed", "none", "model.dtype mixed (bf16, index arithmetic and attention in float32) is OpenVINO's"),
    ("torch", "float32", "int8", "model.quantize int8 needs model.backend onnx or openvino"),
])
def test_prepare_refuses_what_the_servers_load_refuses_with_exit_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], backend: str, dtype: str, quantize: str,
        words: str) -> None:
    """A configuration the server refuses at load is a refused configuration (2), before anything loads: not a
    failed export (1), nor a cache said to be ready for a server that will not start (0)."""
    monkeypatch.setattr(prepare_module, "judge", lambda *a: pytest.fail("loaded a refused configuration"))
    settings = auto_settings(backend=backend, dtype=dtype, quantize=quantize)
    assert prepare_module.prepare(settings) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1 and words in said.err


def test_prepare_stops_at_the_first_failure_that_is_not_the_gates_and_says_it_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An unwritable cache folder or a missing model fails every candidate alike: said once, not once per candidate."""
    judged: list[str] = []

    def judge(spec: Any, runtime: dict[str, str]) -> dict[str, Any]:
        judged.append(runtime["dtype"])
        return {"state": "failed", "reason": "model.cache_dir /ro is not writable (Read-only file system)",
                "seconds": 0.1}

    monkeypatch.setattr(prepare_module, "judge", judge)
    monkeypatch.setattr(prepare_module, "cpu_flags", lambda: AMX)
    monkeypatch.setattr("inferd.core.backends.auto.util.find_spec", lambda name: object())
    assert prepare_module.prepare(auto_settings()) == 1
    said = capsys.readouterr()
    out = json.loads(said.out)
    assert judged == ["mixed"] and not out["ready"]
    assert said.err.count("is not writable") == 1 and "openvino-mixed failed" in said.err
    for name in ("openvino-bfloat16", "openvino-float32-int8", "openvino-float32"):
        assert out["candidates"][name] == {"state": "skipped", "reason": "not judged: openvino-mixed failed first"}


def test_a_candidate_whose_load_raises_anything_is_one_failed_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenVINO raises RuntimeError on a damaged graph: a verdict of that candidate, in one line, not a traceback."""
    def load(spec: Any) -> None:
        raise RuntimeError("Exception from src/core/src/runtime/ov_tensor.cpp: Incorrect weights in bin file!")

    monkeypatch.setattr(prepare_module, "load_handler", load)
    spec = ModelSpec(Path("/m"), "1", backend="auto", device="cpu")
    verdict = prepare_module.judge(spec, {"backend": "openvino", "dtype": "mixed", "quantize": "none"})
    assert verdict["state"] == "failed"
    assert verdict["reason"] == ("RuntimeError: Exception from src/core/src/runtime/ov_tensor.cpp: Incorrect weights "
                                 "in bin file!")
