"""The drift report on the real all-MiniLM-L6-v2: OpenVINO static int8 shadowing torch fp32 keeps the space
(high cosine, neighbourhoods kept); kept short (one int8 export with a small gate and calibration set, 160 texts:
about 50 s on two cores, nearly all of it the export)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.config import GateSettings, ModelSettings, resolve_model_path
from inferd.core.backends.base import BackendError, cpu_flags, quantize_warning
from inferd.core.loading import load_handler
from inferd.core.shadow import DriftReport, verdict
from inferd.core.spec import ModelSpec
from inferd.corpus import texts as corpus_texts

pytestmark = pytest.mark.model

TEXTS = corpus_texts(160, seed=22)
# A smaller gate and calibration set than the defaults: the export is what the test waits for.
GATE = (("texts", 32), ("calibration_texts", 16))


def vectors(handler: object, texts: list[str]) -> np.ndarray:
    rows = []
    for k in range(0, len(texts), 32):
        rows.append(handler.infer(handler.preprocess(texts[k:k + 32])))  # type: ignore[attr-defined]
    return np.concatenate(rows).astype(np.float64)


@pytest.mark.timeout(600)
def test_openvino_int8_shadowing_torch_keeps_the_space(tmp_path: Path) -> None:
    path = resolve_model_path(ModelSettings())
    reference = load_handler(ModelSpec(path=path, name="minilm", version="1", device="cpu", warmup=False))
    try:
        candidate = load_handler(ModelSpec(path=path, name="minilm", version="int8", device="cpu",
                                           backend="openvino", quantize="int8", cache_dir=str(tmp_path), gate=GATE,
                                           warmup=False))
    except BackendError as exc:
        # Refused by its own gate only on a CPU without int8 dot products (README, Backends).
        assert quantize_warning("int8", cpu_flags()) is not None, str(exc)
        pytest.skip(f"static int8 is refused on this CPU: {exc}")
    a, b = vectors(reference, TEXTS), vectors(candidate, TEXTS)
    report = DriftReport("embedding", "int8")
    for k in range(0, len(TEXTS), 8):
        report.add(list(a[k:k + 8]), list(b[k:k + 8]), f"r{k}", [len(t) for t in TEXTS[k:k + 8]])
    figures = report.figures()
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert figures["cosine_mean"] == pytest.approx(float(cos.mean()), abs=1e-6)
    assert figures["cosine_mean"] >= 0.995 and figures["cosine_min"] >= 0.98
    assert figures["overlap_mean"] >= 0.9
    # 160 texts are enough traffic for a verdict; whether int8 passes its bounds here is its gate's business.
    assert verdict("embedding", report.items, figures, GateSettings(), 100).code != "shadow_insufficient"
    reference.close()
    candidate.close()
