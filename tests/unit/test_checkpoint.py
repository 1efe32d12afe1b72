"""A folder's config.json held to its checkpoint's headers before anything is built (core/checkpoint.py, issue 39
items 1 and 9): tiny BERT folders with one figure of config.json changed, and the folders that must still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors import SafetensorError
from tinymodel import write_tiny_bert, write_tiny_classifier

from inferd.core import checkpoint
from inferd.core.backends.base import BackendError
from inferd.core.backends.torch import load_model, skeleton
from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("ckpt") / "tiny", seed=1)


def edited(source: Path, where: Path, **config: Any) -> Path:
    """A copy of ``source`` whose config.json says ``config`` over its own."""
    folder = Path(shutil.copytree(source, where / "edited", dirs_exist_ok=True))
    (folder / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **config}))
    return folder


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model fails the test: a refusal must come from the headers, before transformers builds."""
    from transformers import AutoModel

    def build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was built before the checkpoint check refused it")

    monkeypatch.setattr(AutoModel, "from_pretrained", build)


def test_a_hundred_thousand_layers_over_a_two_layer_checkpoint_are_refused_before_building(
        tiny: Path, tmp_path: Path, nothing_built: None) -> None:
    folder = edited(tiny, tmp_path, num_hidden_layers=100_000)
    with pytest.raises(ModelLoadError) as caught:
        load_handler(ModelSpec(folder, "x", device="cpu"))
    message = str(caught.value)
    assert "num_hidden_layers is 100000" in message and "holds 2 layers (encoder.layer.0-1)" in message
    assert "model.safetensors" in message and str(tmp_path) not in message  # the folder's name, not where it is


def test_a_checkpoint_with_layers_the_config_does_not_name_is_refused(tiny: Path, tmp_path: Path) -> None:
    # Issue 39 item 9: transformers loads layer 0 and drops layer 1 with a warning, serving other vectors.
    folder = edited(tiny, tmp_path, num_hidden_layers=1)
    with pytest.raises(BackendError, match=r"num_hidden_layers is 1, the checkpoint \(model.safetensors\) holds 2 "
                                           r"layers .* the layers past it would be dropped"):
        load_model(folder, True)


@pytest.mark.parametrize(("change", "says"), [
    ({"hidden_size": 64}, "hidden_size is 64, the checkpoint's embeddings.word_embeddings.weight (model.safetensors) "
                          "is 32 wide"),
    ({"vocab_size": 5000}, "vocab_size is 5000, the checkpoint's embeddings.word_embeddings.weight "
                           "(model.safetensors) has"),
    # Sizes no tensor name carries: held by the parameter count of the model the config describes.
    ({"intermediate_size": 64 * 100_000}, "config.json describes a model of"),
    ({"max_position_embeddings": 10_000_000}, "config.json describes a model of"),
])
def test_a_config_the_checkpoint_contradicts_is_refused_naming_both_figures(
        tiny: Path, tmp_path: Path, nothing_built: None, change: dict[str, int], says: str) -> None:
    with pytest.raises(BackendError) as caught:
        load_model(edited(tiny, tmp_path, **change), True)
    assert says in str(caught.value)
    if "parameters" in says:
        assert "the checkpoint (model.safetensors) holds" in str(caught.value)


def test_the_size_check_counts_on_the_meta_device(tiny: Path, tmp_path: Path) -> None:
    """The model of 6.4 million intermediate units is counted, never allocated: its count is exact."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(edited(tiny, tmp_path, intermediate_size=1_000_000))
    model = skeleton(AutoModel, config)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 2 * 32 * 1_000_000 * 2


def test_folders_that_fit_still_load(tmp_path: Path) -> None:
    """What a checkpoint may legitimately hold beyond the model or lack: a masked-LM head an encoder does not read,
    a pooler an embedding model does not read; a classifier reads its pooler, and has it."""
    from transformers import BertConfig, BertForMaskedLM, BertModel

    plain = write_tiny_bert(tmp_path / "plain", seed=1)
    assert load_model(plain, True) is not None
    config = BertConfig(**{k: v for k, v in json.loads((plain / "config.json").read_text()).items()
                           if k not in ("architectures", "transformers_version", "model_type")})
    with_head = Path(shutil.copytree(plain, tmp_path / "mlm"))
    BertForMaskedLM(config).save_pretrained(with_head)
    assert load_model(with_head, True) is not None
    no_pooler = Path(shutil.copytree(plain, tmp_path / "no-pooler"))
    BertModel(config, add_pooling_layer=False).save_pretrained(no_pooler)
    assert load_model(no_pooler, True) is not None
    classifier = write_tiny_classifier(tmp_path / "classifier", seed=1)
    assert load_model(classifier, True, head="logits") is not None


def test_pickle_weights_are_read_for_their_shapes_only(tmp_path: Path, nothing_built: None) -> None:
    """pytorch_model.bin (model.allow_pickle) is held to its config the same way, its tensors memory-mapped."""
    folder = write_tiny_bert(tmp_path / "pickled", seed=1, pickle_weights=True)
    held = checkpoint.read_held(folder, safetensors=False)
    assert held is not None and held.files == ("pytorch_model.bin",)
    assert held.tensors["embeddings.word_embeddings.weight"][0][1] == 32
    runaway = edited(folder, tmp_path, num_hidden_layers=100_000)
    with pytest.raises(BackendError, match="num_hidden_layers is 100000, the checkpoint \\(pytorch_model.bin\\) "
                                           "holds 2 layers"):
        load_model(runaway, False)


def test_a_sharded_checkpoint_is_read_across_its_shards(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(tiny, tmp_path / "sharded"))
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n].contiguous() for n in part}, folder / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    held = checkpoint.read_held(folder, safetensors=True)
    assert held is not None and len(held.files) == 2
    assert held.elements == sum(t.numel() for t in state.values())


def test_a_header_that_is_not_safetensors_is_left_to_the_library_to_name(tiny: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny, tmp_path / "corrupt"))
    (folder / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 64)
    assert checkpoint.read_held(folder, safetensors=True) is None
    with pytest.raises(SafetensorError, match="header"):  # as before the check (the manager's load names it)
        load_model(folder, True)


def test_layers_are_counted_per_stack_whatever_the_prefix() -> None:
    assert checkpoint.layers_held(["bert.encoder.layer.0.a", "bert.encoder.layer.1.a", "cls.x"]) == (
        "bert.encoder.layer", [0, 1])
    assert checkpoint.layers_held(["model.layers.0.a", "model.layers.11.b", "lm_head.weight"]) == (
        "model.layers", [0, 11])
    assert checkpoint.layers_held(["transformer.layer.3.x"]) == ("transformer.layer", [3])
    assert checkpoint.layers_held(["embeddings.word_embeddings.weight"]) is None
    assert checkpoint.unexpected_layers(["cls.predictions.bias", "encoder.layer.1.output.dense.weight",
                                         "embeddings.position_ids"]) == ["encoder.layer.1.output.dense.weight"]


def test_unused_layer_weights_are_refused_after_the_build_too(tiny: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The second net (the header check aside): transformers' unexpected keys of a numbered layer refuse a load."""
    monkeypatch.setattr(checkpoint, "read_held", lambda path, safetensors: None)
    with pytest.raises(BackendError, match=r"\d+ of layers it does not name, e\.g\. \['encoder\.layer\.1\."):
        load_model(edited(tiny, tmp_path, num_hidden_layers=1), True)


def test_a_model_that_would_not_fit_in_the_memory_left_is_refused_before_building(
        tiny: Path, monkeypatch: pytest.MonkeyPatch, nothing_built: None) -> None:
    monkeypatch.setattr(checkpoint, "memory_available", lambda: 64 * 1024)
    with pytest.raises(BackendError, match=r"tiny: the model needs 1\d\d\.\d KiB to build, and this process has "
                                           r"64\.0 KiB of memory left"):
        load_model(tiny, True)
