"""An EmbeddingGemma-shaped folder (Gemma3's text model with ``use_bidirectional_attention``, sliding-window and
full-attention layers, mean pooling, two Dense modules, Normalize) exports to ONNX Runtime and OpenVINO and
answers what sentence-transformers answers, its texts longer than the sliding window batched with short ones.

Its own mask code runs under torch.vmap, which the tracer cannot record (both converters failed with
"unordered_map::at"): the export builds the masks outside (core/backends/masks.py). The masks are checked
against the model's own, the exports against sentence-transformers and through the accuracy gate.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from decoders import qwen3_config, write_qwen_tokenizer

from inferd.core.backends import masks
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec

WINDOW = 6
# Short texts and texts several windows long, in one batch: padding and the window both shape the masks.
TEXTS = ["a dog", "the cat sat on the mat and looked at the bird in the tree for a long while",
         "river " * 30, "one two three", "light and sound and water " * 8]


def write_embeddinggemma(folder: Path, seed: int = 3) -> Path:
    """EmbeddingGemma's layout on a tiny random Gemma3 text model: Transformer, mean Pooling, Dense up, Dense down
    (no bias, identity activation), Normalize."""
    from sentence_transformers.models import Dense
    from transformers import AutoModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_qwen_tokenizer(folder, append_eos=True, max_positions=128, padding_side="right")
    config = qwen3_config(vocab, 128, seed, "gemma3_text", use_bidirectional_attention=True,
                          sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    AutoModel.from_config(config).eval().save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}))
    torch.manual_seed(seed + 1)
    for path, (a, b) in (("2_Dense", (32, 64)), ("3_Dense", (64, 32))):
        (folder / path).mkdir(exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the modules' import path moves in sentence-transformers 6
            Dense(a, b, bias=False, activation_function=torch.nn.Identity()).save(str(folder / path))
    (folder / "4_Normalize").mkdir(exist_ok=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "task: search result | query: ", "document": "title: none | text: "},
        "default_prompt_name": None, "similarity_fn_name": "cosine"}))
    return folder


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_embeddinggemma(tmp_path_factory.mktemp("embeddinggemma") / "model")


@pytest.fixture(scope="module")
def expected(gemma: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(gemma), device="cpu")
    return model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)


def _vectors(path: Path, **kw: Any) -> tuple[np.ndarray, Any]:
    handler = load_handler(ModelSpec(path, "1", name="gemma", device="cpu", warmup=False, **kw))
    return np.array(handler.postprocess(handler.infer(handler.preprocess(TEXTS)))), handler


def test_the_masks_built_outside_equal_the_models_own(gemma: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(gemma, attn_implementation="eager").eval()
    assert masks.bidirectional(model)
    batch = AutoTokenizer.from_pretrained(gemma)(TEXTS, padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[1] > 3 * WINDOW and not bool(batch["attention_mask"].all())
    with torch.no_grad():
        own = model(**batch).last_hidden_state
        outside = model(input_ids=batch["input_ids"],
                        attention_mask=masks.prepared(model, batch["attention_mask"], torch.float32)).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(outside[real], own[real], atol=1e-5, rtol=0)
    # The window matters: seeing every key in the sliding layer computes something else.
    full_everywhere = dict(masks.prepared(model, batch["attention_mask"], torch.float32))
    full_everywhere[masks.SLIDING] = full_everywhere[masks.FULL]
    with torch.no_grad():
        wrong = model(input_ids=batch["input_ids"], attention_mask=full_everywhere).last_hidden_state
    assert float((wrong[real] - own[real]).abs().max()) > 1e-3


def test_a_causal_gemma_keeps_its_own_masks() -> None:
    from transformers import AutoModel

    for bidirectional, expected in ((False, False), (True, True)):
        config = qwen3_config(64, 128, 0, "gemma3_text", use_bidirectional_attention=bidirectional,
                              sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
        assert masks.bidirectional(AutoModel.from_config(config)) is expected


def test_it_serves_on_torch_as_sentence_transformers(gemma: Path, expected: np.ndarray) -> None:
    got, _ = _vectors(gemma)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["openvino", "onnx"])
def test_it_exports_and_answers_as_sentence_transformers(gemma: Path, expected: np.ndarray, tmp_path: Path,
                                                         backend: str) -> None:
    # 64 of the gate's texts (its smallest useful set) keep the export's judging short.
    got, handler = _vectors(gemma, backend=backend, cache_dir=str(tmp_path), gate={"texts": 64})
    info = handler.loaded.backend_info
    assert info["backend"] == backend and info["gate"]["passed"]
    assert info["gate"]["figures"]["cosine_min"] >= 0.9999
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
