"""A SPLADE model weighs every id of its vocabulary: one whose vocabulary (config.json vocab_size) is larger than
its tokenizer's is refused at load, naming both (issue 39: the ids past the tokenizer's came back as "" tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinymodel import _tiny_encoder_config

from inferd.core.errors import ModelLoadError
from inferd.core.spec import ModelSpec
from inferd.core.tasks.sparse import SparseHandler


def masked_lm(folder: Path, extra_ids: int) -> Path:
    from transformers import BertForMaskedLM

    config = _tiny_encoder_config(folder, 8, 32, 2, 64)
    config.vocab_size += extra_ids
    BertForMaskedLM(config).eval().save_pretrained(folder)
    return folder


def load(folder: Path) -> SparseHandler:
    handler = SparseHandler()
    handler.load(ModelSpec(folder, "1", pooling="splade", device="cpu", warmup=False), torch.device("cpu"))
    return handler


def test_a_vocabulary_larger_than_the_tokenizer_s_is_refused_at_load(tmp_path: Path) -> None:
    padded = masked_lm(tmp_path / "padded", extra_ids=8)
    ids = len((padded / "vocab.txt").read_text(encoding="utf-8").splitlines())
    with pytest.raises(ModelLoadError, match=rf"{ids + 8} weights per text \(config.json vocab_size\) but its "
                                             rf"tokenizer has a token for {ids} of those ids \(none for {ids}"):
        load(padded)
    matching = load(masked_lm(tmp_path / "matching", extra_ids=0))
    try:
        assert "" not in set(matching.vocab)
    finally:
        matching.close()
