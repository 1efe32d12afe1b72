"""OpenVINO's mixed precision (``model.dtype: mixed``) on a tiny random MPNet, whose relative-position buckets are
integers computed through floats (a log, a quotient, a product, then a truncation).

The recipe is applied: the bucket arithmetic runs in float32 in the compiled graph while the matrix products run
in bf16; the gate judges it by the half bounds and passes it; and it refuses it, naming the bound, when the bound
is out of reach. bf16 arithmetic needs a CPU that has it: elsewhere OpenVINO compiles float32 and there is nothing
to see.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tinymodel import write_tiny_bert

from inferd.core.backends.base import BackendError, cpu_flags, native_bf16
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec

pytestmark = pytest.mark.skipif(not native_bf16(cpu_flags()),
                                reason="needs a CPU with native bf16 (avx512_bf16 or amx_bf16 in /proc/cpuinfo)")

TEXTS = ["a dog", "the cat sat on the mat and looked at the bird " * 6, "river and sound", "one " * 90]
# The gate's smallest useful set keeps each export's judging short.
GATE = {"texts": 64}


def write_tiny_mpnet(folder: Path, seed: int = 0, max_positions: int = 128) -> Path:
    """A sentence-transformers MPNet folder (mean pooling) on the tiny BERT tokenizer, with 32 position buckets."""
    from transformers import MPNetConfig, MPNetModel

    write_tiny_bert(folder, seed=seed, max_positions=max_positions)
    vocab = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
    torch.manual_seed(seed)
    # MPNet's positions start after the padding id, as RoBERTa's: two more than the longest text.
    config = MPNetConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=max_positions + 2,
                         relative_attention_num_buckets=32, initializer_range=0.2, pad_token_id=0)
    (folder / "model.safetensors").unlink()
    MPNetModel(config).eval().save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "mpnet"
    return folder


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mpnet(tmp_path_factory.mktemp("mpnet") / "model")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One export cache for the module: the refusal re-judges the passing entry's stored figures under a bound out
    of reach, as a warm start does, without a second export."""
    return tmp_path_factory.mktemp("cache")


def _handler(path: Path, **kw: Any) -> Any:
    return load_handler(ModelSpec(path, "1", name="mpnet", device="cpu", warmup=False, backend="openvino", **kw))


def test_mixed_keeps_the_bucket_arithmetic_in_float32_and_passes_the_gate(mpnet: Path, cache: Path) -> None:
    handler = _handler(mpnet, dtype="mixed", cache_dir=str(cache), gate=GATE)
    info = handler.loaded.backend_info
    assert info["dtype"] == "mixed" and info["inference_precision"] == "bf16"
    assert info["gate"]["kind"] == "half" and info["gate"]["passed"]
    kept = info["kept_float32"]
    assert any("log" in name.lower() for name in kept), kept
    assert any("aten::matmul" in name for name in kept), kept
    runtime = handler.runner.runtime_precisions()
    # What the recipe keeps runs in float32 (a conversion's precision is its input's: i32 for int -> float), none
    # in bf16; the matrix products of a value by a weight still run in bf16. The plugin fuses attention (its two
    # products, the softmax between) into one operation that runs in float32 and names the second product only.
    found = set(kept) & set(runtime)
    assert {name for name in kept if "aten::log" in name.lower()} <= found
    assert "bf16" not in {runtime[name] for name in found}
    assert {runtime[name] for name in kept if "aten::log" in name.lower()} == {"f32"}
    attention = [runtime[name] for name in found if "aten::matmul" in name]
    assert attention and set(attention) == {"f32"}
    products = [p for name, p in runtime.items() if "linear" in name]
    assert products and set(products) == {"bf16"}
    torch_handler = load_handler(ModelSpec(mpnet, "1", name="mpnet", device="cpu", warmup=False))
    got, want = (np.array(h.postprocess(h.infer(h.preprocess(TEXTS)))) for h in (handler, torch_handler))
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9995


def test_plain_bf16_rounds_the_bucket_arithmetic(mpnet: Path, tmp_path: Path) -> None:
    """Without the recipe the same operations run in bf16: what mixed changes is real."""
    handler = _handler(mpnet, dtype="bfloat16", cache_dir=str(tmp_path), gate={**GATE, "half_cosine_min": 0.9})
    runtime = handler.runner.runtime_precisions()
    logs = [p for name, p in runtime.items() if "aten::log" in name.lower()]
    rounded = [p for name, p in runtime.items() if "encoder/aten::" in name and p == "bf16"]
    assert logs and rounded


def test_the_gate_refuses_mixed_when_its_bound_is_out_of_reach(mpnet: Path, cache: Path) -> None:
    with pytest.raises(BackendError, match=r"half_cosine_min|cosine min") as refused:
        _handler(mpnet, dtype="mixed", cache_dir=str(cache), gate={**GATE, "half_cosine_min": 1.0})
    assert "refused by the accuracy gate" in str(refused.value)


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_mixed_is_openvinos_alone(mpnet: Path, backend: str) -> None:
    with pytest.raises(BackendError, match="model.dtype mixed"):
        load_handler(ModelSpec(mpnet, "1", name="mpnet", device="cpu", warmup=False, backend=backend, dtype="mixed"))
