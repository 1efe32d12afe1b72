"""Which sparse and late-interaction folders inferd serves, told by their files alone, and what it refuses, naming
it (issue 32): a SparseEncoder chain of anything but a fill-mask Transformer and SpladePooling (inference-free
SPLADE's Router, a static sparse embedding, a sparse autoencoder), a SpladePooling of an unknown strategy, and a
Stanford ColBERT checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferd.core.errors import ModelLoadError
from inferd.core.tasks.handlers import detect_task
from inferd.core.tasks.multivector import is_colbert
from inferd.core.tasks.sparse import is_splade
from inferd.core.tasks.st_folder import read_folder
from inferd.core.tasks.st_modules import Splade

ST = "sentence_transformers."
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": ST + "base.modules.transformer.Transformer"}
SPLADE = {"idx": 1, "name": "1", "path": "1_SpladePooling",
          "type": ST + "sparse_encoder.modules.splade_pooling.SpladePooling"}
FILL_MASK = {"transformer_task": "fill-mask",
             "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
             "module_output_name": "token_embeddings"}


def folder(root: Path, modules: list[dict], pooling: dict | None = None, transformer: dict | None = None,
           archs: tuple[str, ...] = ("BertForMaskedLM",)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": list(archs)}))
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "sentence_bert_config.json").write_text(json.dumps(transformer or FILL_MASK))
    (root / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "SparseEncoder"}))
    (root / "1_SpladePooling").mkdir(exist_ok=True)
    (root / "1_SpladePooling" / "config.json").write_text(json.dumps(
        pooling or {"pooling_strategy": "max", "activation_function": "log1p_relu"}))
    return root


def test_a_splade_folder_is_an_embedding_model_with_its_pooling_read(tmp_path: Path) -> None:
    f = folder(tmp_path / "splade", [TRANSFORMER, SPLADE])
    assert read_folder(f).splade == Splade("max", "log1p_relu")
    assert is_splade(f) and not is_colbert(f) and detect_task(f) == "embedding"


@pytest.mark.parametrize(("modules", "pooling", "transformer", "words"), [
    ([{"idx": 0, "name": "0", "path": "", "type": ST + "base.modules.router.Router"}], None, None,
     "Router) is not a module inferd runs"),
    ([TRANSFORMER, SPLADE, {"idx": 2, "name": "2", "path": "2_SAE",
                            "type": ST + "sparse_encoder.modules.sparse_auto_encoder.SparseAutoEncoder"}],
     None, None, "SparseAutoEncoder) is not a module inferd runs"),
    ([{"idx": 0, "name": "0", "path": "", "type": ST + "sparse_encoder.modules.SparseStaticEmbedding"}, SPLADE],
     None, None, "SparseStaticEmbedding) is not a module inferd runs"),
    ([TRANSFORMER, SPLADE], {"pooling_strategy": "mean"}, None, "pooling_strategy 'mean' is not one of max, sum"),
    ([TRANSFORMER, SPLADE], None, {"transformer_task": "feature-extraction"},
     "transformer_task 'feature-extraction'; the modules after it read fill-mask's output"),
])
def test_what_cannot_run_is_refused_by_name(tmp_path: Path, modules: list[dict], pooling: dict | None,
                                            transformer: dict | None, words: str) -> None:
    with pytest.raises(ModelLoadError, match=words.replace("(", r"\(").replace(")", r"\)")):
        read_folder(folder(tmp_path / "f", modules, pooling, transformer))


def test_a_stanford_colbert_checkpoint_is_refused_naming_pylate_s_layout(tmp_path: Path) -> None:
    f = tmp_path / "colbertv2"
    f.mkdir()
    (f / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["HF_ColBERT"]}))
    with pytest.raises(ModelLoadError, match="Stanford ColBERT checkpoint \\(HF_ColBERT\\).*PyLate's layout"):
        detect_task(f)
