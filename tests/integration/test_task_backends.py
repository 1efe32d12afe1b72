"""Rerank and classification on every backend, against sentence-transformers and transformers' pipeline.

One contract: a runner returns a classification head's logits on torch (padded and unpadded), ONNX Runtime
and OpenVINO (fp32, bf16, int8 weights, static int8), exported with the head through the same exporters as
encoders. fp32 graphs must give ``CrossEncoder.predict``'s scores and the pipeline's probabilities (≤ 1e-5);
reduced precisions must pass the score gate (ranking per query, label agreement, bounded differences) or be
refused with the figure that failed. The server shows the gate's figures in /info.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import Server, metric_value
from tinymodel import WORDS, write_tiny_classifier, write_tiny_cross_encoder

from inferd.core.agreement import spearman
from inferd.core.backends.base import BackendError, cpu_flags, native_bf16
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec

TOL = 1e-5
SMALL = (("texts", 64), ("calibration_texts", 64))
# Every configuration a runner of a classification head can be opened in.
CONFIGS = [("torch", "float32", "none", "false"), ("torch", "float32", "none", "true"),
           ("torch", "bfloat16", "none", "auto"), ("onnx", "float32", "none", "auto"),
           ("onnx", "float32", "int8", "auto"), ("openvino", "float32", "none", "auto"),
           ("openvino", "bfloat16", "none", "auto"), ("openvino", "float32", "int8-weights", "auto"),
           ("openvino", "float32", "int8", "auto")]
IDS = ["-".join(c) for c in CONFIGS]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("task-backends")
    write_tiny_cross_encoder(root / "ce", seed=3)
    write_tiny_classifier(root / "cls", seed=5)
    write_tiny_classifier(root / "multi", seed=6, multi_label=True)
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("task-backend-cache")


def spec(path: Path, cache: Path, task: str, config: tuple[str, str, str, str],
         gate: tuple[tuple[str, float], ...] = ()) -> ModelSpec:
    backend, dtype, quantize, unpadded = config
    return ModelSpec(path=path, name="tiny", version="1", device="cpu", task=task, backend=backend, dtype=dtype,
                     quantize=quantize, unpadded=unpadded == "true" if unpadded != "auto" else "auto",
                     cache_dir=str(cache), gate=(*SMALL, *gate), warmup=False)


def load_or_refusal(s: ModelSpec):  # noqa: ANN201 - a handler or the refusal
    try:
        return load_handler(s)
    except BackendError as exc:
        return exc


def rerank_pairs() -> list[tuple[str, str]]:
    rng = random.Random(1)
    out = []
    for q in range(4):
        query = _sentence(rng, 3 + q)
        out += [(query, _sentence(rng, n)) for n in (2, 6, 12, 25, 40, 70, 120, 5)]  # 120: cut at the limit
    return out


def texts() -> list[str]:
    rng = random.Random(3)
    return [_sentence(rng, n) for n in (1, 3, 5, 8, 12, 20, 30, 45, 60, 90, 2, 4)]


@pytest.fixture(scope="module")
def cross_encoder_scores(models: Path) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(CrossEncoder(str(models / "ce"), device="cpu").predict(rerank_pairs()))


@pytest.fixture(scope="module")
def pipeline_probs(models: Path) -> dict[str, np.ndarray]:
    from transformers import pipeline

    out = {}
    for name, labels in (("cls", ("negative", "neutral", "positive")), ("multi", ("negative", "neutral", "positive"))):
        pipe = pipeline("text-classification", model=str(models / name), top_k=None, device="cpu")
        rows = [{x["label"]: x["score"] for x in row} for row in pipe(texts(), truncation=True)]
        out[name] = np.array([[row[label] for label in labels] for row in rows])
    return out


def scores_of(h, pairs: list[tuple[str, str]]) -> np.ndarray:  # noqa: ANN001
    """Scores alone, and in one mixed batch: both must hold."""
    batched = h.infer(h.preprocess(pairs))[:, 0]
    alone = np.array([h.infer(h.preprocess([p]))[0, 0] for p in pairs[:8]])
    return batched, alone


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_rerank_on_every_backend_equals_the_cross_encoder_or_is_refused_by_its_gate(
        models: Path, cache: Path, cross_encoder_scores: np.ndarray, config: tuple[str, str, str, str]) -> None:
    h = load_or_refusal(spec(models / "ce", cache, "rerank", config))
    backend, dtype, quantize, unpadded = config
    if isinstance(h, BackendError):
        # Only a reduced precision may be refused, and the refusal names the figure and its setting.
        assert (dtype, quantize) != ("float32", "none"), str(h)
        assert "refused by the accuracy gate" in str(h) and "model.gate." in str(h)
        assert any(name in str(h) for name in ("Spearman mean", "top-3 agreement", "max diff"))
        return
    if (backend, dtype) == ("openvino", "bfloat16") and not native_bf16(cpu_flags()):
        dtype = "float32"  # OpenVINO would compile float32 here anyway: it is said, and served, as float32
    assert (h.loaded.backend, h.loaded.dtype, h.loaded.quantize, h.runner.head) == (backend, dtype, quantize, "logits")
    if backend == "torch":
        assert h.runner.capabilities.pads is (unpadded == "false")
    batched, alone = scores_of(h, rerank_pairs())
    np.testing.assert_allclose(alone, batched[:8], atol=TOL if dtype == "float32" and quantize == "none" else 0.02)
    if (dtype, quantize) == ("float32", "none"):
        np.testing.assert_allclose(batched, cross_encoder_scores, atol=TOL, rtol=0)
        if backend != "torch":
            gate = h.loaded.backend_info["gate"]
            assert gate["kind"] == "fp32" and gate["passed"]
            assert gate["figures"]["spearman_mean"] >= 0.9999 and gate["figures"]["score_diff_max"] <= 1e-4
        return
    # A reduced precision that passed its gate ranks each query's documents as the cross-encoder does.
    ranks = [spearman(batched[k:k + 8], cross_encoder_scores[k:k + 8]) for k in range(0, len(batched), 8)]
    assert min(ranks) >= 0.9, ranks
    if backend != "torch":
        figures = h.loaded.backend_info["gate"]["figures"]
        assert figures["spearman_mean"] >= 0.995 and figures["top3_agreement"] >= 0.95


# The multi-label model differs from the single-label one in its activation only: one configuration per backend
# (and bf16) covers it; every precision and quantisation runs on the single-label model.
MULTI = [("torch", "float32", "none", "auto"), ("onnx", "float32", "none", "auto"),
         ("openvino", "float32", "none", "auto"), ("openvino", "bfloat16", "none", "auto")]
CLASSIFY = [("cls", c) for c in CONFIGS] + [("multi", c) for c in MULTI]


@pytest.mark.parametrize(("name", "config"), CLASSIFY, ids=[f"{n}-{'-'.join(c)}" for n, c in CLASSIFY])
def test_classification_on_every_backend_equals_the_pipeline_or_is_refused_by_its_gate(
        models: Path, cache: Path, pipeline_probs: dict[str, np.ndarray], config: tuple[str, str, str, str],
        name: str) -> None:
    h = load_or_refusal(spec(models / name, cache, "classification", config))
    dtype, quantize = config[1], config[2]
    if isinstance(h, BackendError):
        assert (dtype, quantize) != ("float32", "none"), str(h)
        assert "refused by the accuracy gate" in str(h) and ("label agreement" in str(h) or "max diff" in str(h))
        return
    got = h.infer(h.preprocess(texts()))
    alone = h.infer(h.preprocess(texts()[3:4]))[0]
    want = pipeline_probs[name]
    if (dtype, quantize) == ("float32", "none"):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        np.testing.assert_allclose(alone, got[3], atol=TOL, rtol=0)
    else:
        np.testing.assert_allclose(got, want, atol=0.06, rtol=0)
        if name == "cls":
            assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.9


def test_a_loosened_score_gate_serves_what_the_default_refuses(models: Path, cache: Path) -> None:
    """The gate is a setting: the operator who accepts a lower rank agreement gets the configuration, and
    the stored figures are judged again without a new export."""
    config = ("onnx", "float32", "int8", "auto")
    strict = load_or_refusal(spec(models / "ce", cache, "rerank", config, gate=(("rerank_spearman_min", 1.0),)))
    assert isinstance(strict, BackendError) and "< 1.0 (model.gate.rerank_spearman_min)" in str(strict)
    loose = load_or_refusal(spec(models / "ce", cache, "rerank", config, gate=(
        ("rerank_spearman_min", 0.0), ("rerank_top3_min", 0.0), ("int8_score_diff_max", 1.0))))
    assert not isinstance(loose, BackendError), str(loose)
    assert loose.loaded.backend_info["cache"] == "hit"
    assert loose.loaded.backend_info["gate"]["thresholds"]["rerank_spearman_min"] == 0.0


def test_the_server_serves_rerank_on_openvino_and_shows_the_score_gate(models: Path, cache: Path,
                                                                       serve: Callable[..., Server],
                                                                       cross_encoder_scores: np.ndarray) -> None:
    server = serve({
        "INFERD__MODEL__PATH": str(models / "ce"), "INFERD__MODEL__LOAD_MODE": "eager",
        "INFERD__MODEL__BACKEND": "openvino", "INFERD__MODEL__CACHE_DIR": str(cache),
        # The gate's sizes of the configurations above: run after them, the server starts from their cache entry.
        "INFERD__MODEL__GATE__TEXTS": "64", "INFERD__MODEL__GATE__CALIBRATION_TEXTS": "64",
        "INFERD__CACHE__MAX_ENTRIES": "0"}, wait="/health/ready")
    pairs = rerank_pairs()[:8]
    r = httpx.post(server.url + "/v1/rerank", json={"query": pairs[0][0], "documents": [d for _, d in pairs]},
                   timeout=60)
    assert r.status_code == 200, r.text
    got = {item["index"]: item["relevance_score"] for item in r.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(8)], cross_encoder_scores[:8], atol=TOL, rtol=0)
    model = httpx.get(server.url + "/info").json()["models"][0]
    assert (model["task"], model["backend"], model["backend_info"]["head"]) == ("rerank", "openvino", "logits")
    gate = model["backend_info"]["gate"]
    assert gate["passed"] and gate["kind"] == "fp32" and gate["figures"]["task"] == "rerank"
    assert gate["figures"]["spearman_mean"] >= 0.9999 and gate["figures"]["top3_agreement"] == 1.0
    assert gate["thresholds"]["rerank_spearman_min"] == 0.995
    exposition = httpx.get(server.url + "/metrics").text
    assert metric_value(exposition, "inferd_model_gate_ratio", figure="spearman_mean") >= 0.9999
