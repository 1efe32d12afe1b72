"""The encoder families people serve, each as a tiny random model, against sentence-transformers.

BERT, XLM-RoBERTa, MPNet, DistilBERT, ModernBERT, ELECTRA and DeBERTa-v2, each saved in both sentence-transformers
formats (the 2-4 ``pooling_mode_*`` keys written by hand, and sentence-transformers 6's own ``save``): inferd's
torch output equals ``SentenceTransformer.encode`` within 1e-5, and its OpenVINO fp32 export within 1e-4, texts of
very different lengths batched together and each alone; OpenVINO bf16 is served only when its gate passes it, and
a refusal says the figures it failed on. Each family's quirk is in play: XLM-RoBERTa's positions count from its
padding id, MPNet's relative attention, DistilBERT's forward without segment ids, ModernBERT's sliding-window
layers, ELECTRA's embeddings narrower than its hidden size, DeBERTa's relative positions. The decoder families are
in test_decoders.py.
"""

from __future__ import annotations

import functools
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tinymodel import WORDS, write_st_legacy, write_st_v6, write_tiny_bert, write_tiny_modernbert

from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec

FAMILIES = ("bert", "xlm-roberta", "mpnet", "distilbert", "modernbert", "electra", "deberta-v2")
TEXTS = [" ".join(random.Random(i).choice(WORDS) for _ in range(n)) for i, n in enumerate((1, 3, 12, 40, 90))]


def _bare(folder: Path, family: str) -> Path:
    """A Hugging Face folder of ``family``'s bare encoder, with the tiny BERT's tokenizer ([PAD] is id 0)."""
    import torch
    from transformers import (
        DebertaV2Config,
        DebertaV2Model,
        DistilBertConfig,
        DistilBertModel,
        ElectraConfig,
        ElectraModel,
        MPNetConfig,
        MPNetModel,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    if family == "modernbert":
        write_tiny_modernbert(folder, seed=5, max_positions=512)
    else:
        write_tiny_bert(folder, seed=5, max_positions=128)
    for name in ("modules.json", "sentence_bert_config.json"):
        (folder / name).unlink(missing_ok=True)
    for sub in ("1_Pooling", "2_Normalize"):
        shutil.rmtree(folder / sub, ignore_errors=True)
    if family in ("bert", "modernbert"):
        return folder
    vocab = len((folder / "vocab.txt").read_text(encoding="utf-8").splitlines())
    common: dict[str, Any] = {"vocab_size": vocab, "pad_token_id": 0}
    torch.manual_seed(5)
    if family == "xlm-roberta":  # positions start after the padding id: 130 rows for 128 tokens
        model = XLMRobertaModel(XLMRobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=64, max_position_embeddings=130,
                                                 type_vocab_size=1, initializer_range=0.2, **common))
    elif family == "mpnet":
        model = MPNetModel(MPNetConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=130, initializer_range=0.2,
                                       **common))
    elif family == "electra":
        model = ElectraModel(ElectraConfig(embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                                           initializer_range=0.2, **common))
    elif family == "deberta-v2":
        model = DebertaV2Model(DebertaV2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, max_position_embeddings=128,
                                               relative_attention=True, position_buckets=32,
                                               pos_att_type=["p2c", "c2p"], initializer_range=0.2, **common))
    else:
        model = DistilBertModel(DistilBertConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                                 max_position_embeddings=128, initializer_range=0.2, **common))
    (folder / "model.safetensors").unlink()
    model.eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        bare = _bare(root / f"{family}-bare", family)
        write_st_legacy(root / f"{family}-legacy", bare, pooling=("mean",))
        write_st_v6(root / f"{family}-v6", bare, pooling="mean")
    return root


@functools.cache
def _reference(folder: Path) -> np.ndarray:
    """sentence-transformers' vectors of a folder, computed once: its torch, OpenVINO fp32 and bf16 tests all
    compare with them."""
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)


def _vectors(handler: Any, texts: list[str]) -> np.ndarray:
    return np.asarray(handler.postprocess(handler.infer(handler.preprocess(texts))))


def _check(handler: Any, want: np.ndarray, atol: float) -> None:
    np.testing.assert_allclose(_vectors(handler, TEXTS), want, atol=atol, rtol=0)
    for i in (0, len(TEXTS) - 1):  # alone, as well as padded among texts of very different lengths
        np.testing.assert_allclose(_vectors(handler, TEXTS[i:i + 1])[0], want[i], atol=atol, rtol=0)


@pytest.mark.parametrize("form", ["legacy", "v6"])
@pytest.mark.parametrize("family", FAMILIES)
def test_torch_equals_sentence_transformers(root: Path, family: str, form: str) -> None:
    folder = root / f"{family}-{form}"
    handler = load_handler(ModelSpec(folder, "1", name=family, device="cpu", warmup=False))
    try:
        _check(handler, _reference(folder), 1e-5)
    finally:
        handler.close()


def _openvino(folder: Path, cache: Path, dtype: str) -> Any:
    return load_handler(ModelSpec(folder, "1", name=folder.name, device="cpu", warmup=False, backend="openvino",
                                  dtype=dtype, cache_dir=str(cache), gate={"texts": 32}))


@pytest.mark.parametrize("family", FAMILIES)
def test_openvino_fp32_equals_sentence_transformers(root: Path, tmp_path: Path, family: str) -> None:
    folder = root / f"{family}-v6"
    handler = _openvino(folder, tmp_path, "float32")
    try:
        assert handler.loaded.backend == "openvino" and handler.loaded.backend_info["gate"]["passed"]
        _check(handler, _reference(folder), 1e-4)
    finally:
        handler.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_openvino_bf16_is_served_only_through_its_gate(root: Path, tmp_path: Path, family: str) -> None:
    folder = root / f"{family}-v6"
    try:
        handler = _openvino(folder, tmp_path, "bfloat16")
    except ModelLoadError as exc:  # refused: the message names the figures that missed their bounds
        assert "cosine" in str(exc) or "overlap" in str(exc), str(exc)
        return
    try:
        gate = handler.loaded.backend_info["gate"]
        assert gate["passed"]
        got, want = _vectors(handler, TEXTS), _reference(folder)
        cosine = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert np.isfinite(got).all() and cosine.min() >= 0.99, cosine  # a served graph is the same model
    finally:
        handler.close()
