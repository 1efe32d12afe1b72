"""``inferd prepare``'s walk over backend auto's candidates, without a model: what a refusal settles for the candidates
after it (the judge faked; tests/integration/test_prepare.py runs the real one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from inferd import prepare as prepare_module
from inferd.core.backends.gate_verdict import LESS_PRECISE
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
