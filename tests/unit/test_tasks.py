"""Task detection over real folder layouts, and the pair encoder's truncation (document side first)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tinymodel import write_tiny_bert, write_tiny_classifier, write_tiny_cross_encoder
from tokenizers import Tokenizer

from inferd.core.preprocess import InputError, PairEncoder
from inferd.core.tasks.base import ModelLoadError
from inferd.core.tasks.handlers import HANDLERS, detect_task, handler_for
from inferd.core.tasks.kinds import TASKS


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    st = write_tiny_bert(root / "st")
    bare = write_tiny_bert(root / "bare")
    for name in ("modules.json", "sentence_bert_config.json"):
        (bare / name).unlink()
    ce = write_tiny_cross_encoder(root / "ce")
    cls = write_tiny_classifier(root / "cls")
    both = root / "both"
    shutil.copytree(ce, both)
    shutil.copy(st / "modules.json", both / "modules.json")
    shutil.copytree(st / "1_Pooling", both / "1_Pooling")
    mlm = root / "mlm"
    shutil.copytree(bare, mlm)
    cfg = json.loads((mlm / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    (mlm / "config.json").write_text(json.dumps(cfg))
    return {"st": st, "bare": bare, "ce": ce, "cls": cls, "both": both, "mlm": mlm}


@pytest.mark.parametrize(("name", "task"), [("st", "embedding"), ("bare", "embedding"), ("ce", "rerank"),
                                            ("cls", "classification")])
def test_detect_task_from_the_folder(folders: dict[str, Path], name: str, task: str) -> None:
    assert detect_task(folders[name]) == task


@pytest.mark.parametrize(("name", "why"), [("both", "both sentence-transformers"), ("mlm", "BertForMaskedLM")])
def test_ambiguous_folders_need_an_explicit_task(folders: dict[str, Path], name: str, why: str) -> None:
    with pytest.raises(ModelLoadError, match=f"cannot tell which task.*{why}.*set model.task"):
        detect_task(folders[name])


def test_every_task_object_has_its_handlers_and_no_handler_lacks_one() -> None:
    """A new task is its task object (kinds.py TASKS) and its handlers (handlers.py HANDLERS): one line each."""
    assert list(HANDLERS) == list(TASKS)


@pytest.mark.parametrize(("task", "name", "handler"), [
    ("embedding", "st", "EmbeddingHandler"), ("embedding", None, "EmbeddingHandler"),
    ("rerank", "ce", "RerankHandler"), ("rerank", None, "RerankHandler"),
    ("classification", "cls", "ClassificationHandler"), ("classification", None, "ClassificationHandler")])
def test_each_built_in_task_gets_its_handler(folders: dict[str, Path], task: str, name: str | None,
                                             handler: str) -> None:
    assert type(handler_for(task, folders[name] if name else None)).__name__ == handler


def test_unknown_task_names_the_choices() -> None:
    with pytest.raises(ModelLoadError, match="auto, embedding, rerank, classification"):
        handler_for("summarise")


def test_a_reranker_refuses_a_many_label_model_and_a_classifier_a_one_label_one(folders: dict[str, Path]) -> None:
    import torch

    from inferd.core.tasks.base import ModelSpec

    with pytest.raises(ModelLoadError, match="one label, this model has 3"):
        handler_for("rerank").load(ModelSpec(folders["cls"], "1", name="x"), torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="two labels or more"):
        handler_for("classification").load(ModelSpec(folders["ce"], "1", name="x"), torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer(folders: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_file(str(folders["ce"] / "tokenizer.json"))


def test_pair_encoding_carries_segment_ids_and_cuts_the_document_first(tokenizer: Tokenizer) -> None:
    enc = PairEncoder(tokenizer, 16, truncate=True)
    short, long = enc.encode([("the cat", "a dog"), ("the cat", " ".join(["river"] * 40))])
    assert short.type_ids == [0, 0, 0, 0, 1, 1, 1] and not short.truncated
    assert long.tokens == 16 and long.truncated
    # The query is whole: [CLS] the cat [SEP], then the document's first tokens and its [SEP].
    assert long.ids[:4] == short.ids[:4] and long.type_ids == [0] * 4 + [1] * 12


def test_a_query_longer_than_the_limit_is_cut_too(tokenizer: Tokenizer) -> None:
    enc = PairEncoder(tokenizer, 16, truncate=True)
    (pair,) = enc.encode([(" ".join(["city"] * 40), "a dog")])
    assert pair.tokens == 16 and pair.truncated and 1 in pair.type_ids


def test_without_truncation_a_long_pair_is_refused_naming_it(tokenizer: Tokenizer) -> None:
    enc = PairEncoder(tokenizer, 16, truncate=False)
    with pytest.raises(InputError) as err:
        enc.encode([("q", "a dog"), ("q", " ".join(["river"] * 40))])
    assert err.value.index == 1 and err.value.code == "context_length_exceeded"
