"""Reading a model folder (core/tasks/st_folder.py, core/loading.py check_confined): what its sentence-transformers
files say in each format in use, equal to sentence-transformers' own encode; what inferd refuses, by name; and
every file a load opens staying under the model's root. Handlers are loaded in-process, no server."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prompted import add_prompts
from tinymodel import write_st_legacy, write_st_v6, write_tiny_bert

from inferd.core.errors import ModelLoadError
from inferd.core.loading import check_confined, load_handler
from inferd.core.preprocess import TextEncoder
from inferd.core.spec import ModelSpec
from inferd.core.tasks.embedding import check_prompts
from inferd.core.tasks.st_folder import read_folder
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions

TEXTS = ["Hello World", "the cat and the dog run in the city by the river near the mountain " * 3, "one",
         "a long text: " + "tree house car " * 60]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("source") / "bert", seed=5)


def load(path: Path, **settings: Any) -> Any:
    return load_handler(ModelSpec(path=path, name="t", version="1", device="cpu", warmup=False, **settings))


def reference(path: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(path), device="cpu")


def embed(handler: Any, texts: list[str], prompt: str = "") -> np.ndarray:
    # As admission sends a prompted request: the prompt prepended to each text, and said in the texts' options.
    inputs = [prompt + t for t in texts]
    chosen = InputOptions(TextOptions(prompt=prompt)) if prompt else PLAIN_INPUTS
    return np.stack(handler.postprocess(handler.infer(handler.preprocess(inputs, chosen))))


def assert_same_as_sentence_transformers(path: Path, **settings: Any) -> Any:
    handler, st = load(path, **settings), reference(path)
    names = [None, *handler.prompts] if handler.prompts else [None]
    for name in names:
        prompt = handler.prompts.get(name) if name else handler.prompts.get(handler.default_prompt_name or "", "")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = st.encode(TEXTS, prompt_name=name, convert_to_numpy=True, batch_size=len(TEXTS))
        np.testing.assert_allclose(embed(handler, TEXTS, prompt or ""), expected, atol=1e-5, rtol=0,
                                   err_msg=f"prompt {name!r}")
    assert handler.dimension == st.get_embedding_dimension()
    return handler


# -- equal to sentence-transformers, in both formats ---------------------------------------------------------------

MODES = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]


@pytest.mark.parametrize("fmt", ["v6", "legacy"])
@pytest.mark.parametrize("mode", MODES)
def test_each_pooling_mode_equals_sentence_transformers(bert: Path, tmp_path: Path, mode: str, fmt: str) -> None:
    # Not normalised: mean and mean_sqrt_len_tokens differ only in scale.
    folder = (write_st_v6(tmp_path / "m", bert, pooling=mode, normalize=False) if fmt == "v6"
              else write_st_legacy(tmp_path / "m", bert, pooling=(mode,), normalize=False))
    handler = assert_same_as_sentence_transformers(folder)
    assert handler.loaded.facts.pooling == mode and handler.normalize is False


def test_v6_concatenated_pooling_dense_normalize_and_prompts_left_out(bert: Path, tmp_path: Path) -> None:
    folder = write_st_v6(tmp_path / "m", bert, pooling=["mean", "lasttoken"], dense=16, include_prompt=False,
                         prompts={"query": "query: ", "document": "passage: "}, default_prompt_name="query",
                         similarity="dot")
    handler = assert_same_as_sentence_transformers(folder)
    d = handler.loaded.facts
    assert (d.dimension, d.pooling, d.normalize, d.other["include_prompt"]) == (16, "mean+lasttoken", True, False)
    assert d.similarity_fn_name == "dot" and d.other["dense"] == ["2_Dense: 64->16 Tanh"]


def test_v6_weighted_mean_with_prompts_kept_and_an_identity_dense(bert: Path, tmp_path: Path) -> None:
    folder = write_st_v6(tmp_path / "m", bert, pooling="weightedmean", dense=24, activation="Identity",
                         prompts={"query": "query: "}, default_prompt_name="query")
    assert_same_as_sentence_transformers(folder)


def test_legacy_concatenation_and_a_dense_module(bert: Path, tmp_path: Path) -> None:
    folder = write_st_legacy(tmp_path / "m", bert, pooling=("cls", "max", "mean"), dense=12)
    handler = assert_same_as_sentence_transformers(folder)
    assert handler.loaded.facts.pooling == "cls+max+mean" and handler.similarity_fn_name == "cosine"


def test_legacy_pickled_dense_loads_only_when_pickle_is_allowed(bert: Path, tmp_path: Path) -> None:
    folder = write_st_legacy(tmp_path / "m", bert, pooling=("mean",), dense=8, pickle_dense=True,
                             activation="torch.nn.modules.linear.Identity")
    with pytest.raises(ModelLoadError, match=r"module 2 \(2_Dense: sentence_transformers.models.Dense\) holds "
                                             r"only pickle weights \(2_Dense/pytorch_model.bin\).*allow_pickle"):
        load(folder)
    assert_same_as_sentence_transformers(folder, allow_pickle=True)


def test_do_lower_case_lowercases_before_a_cased_tokenizer(bert: Path, tmp_path: Path) -> None:
    folder = write_st_legacy(tmp_path / "m", bert, normalize=False)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["normalizer"]["lowercase"] = False  # a cased tokenizer: "Hello" is not in the lowercase vocabulary
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": True}))
    handler = assert_same_as_sentence_transformers(folder)
    np.testing.assert_allclose(embed(handler, ["Hello World"]), embed(handler, ["hello world"]), atol=1e-6)


# -- what the folder says, read alone ------------------------------------------------------------------------------


def write_modules(folder: Path, *types: str, paths: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    entries = [{"idx": i, "name": str(i), "path": paths[i] if i < len(paths) else ("" if i == 0 else f"{i}_m"),
                "type": t} for i, t in enumerate(types)]
    (folder / "modules.json").write_text(json.dumps(entries))
    return folder


def pooling_folder(folder: Path, cfg: dict[str, Any]) -> Path:
    write_modules(folder, "sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                  paths=("", "1_Pooling"))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(("cfg", "modes"), [
    ({"pooling_mode": "lasttoken", "embedding_dimension": 32, "include_prompt": True}, ("lasttoken",)),
    ({"pooling_mode": ["max", "cls"]}, ("max", "cls")),
    ({"pooling_mode_lasttoken": True, "pooling_mode_cls_token": True}, ("cls", "lasttoken")),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, ("mean_sqrt_len_tokens",)),
    ({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": False}, ("mean",)),  # none set: mean, as ST
])
def test_pooling_config_in_each_format(tmp_path: Path, cfg: dict[str, Any], modes: tuple[str, ...]) -> None:
    assert read_folder(pooling_folder(tmp_path, cfg)).pooling == modes


def test_a_bare_hugging_face_folder_says_nothing(tmp_path: Path) -> None:
    folder = read_folder(tmp_path)
    assert (folder.pooling, folder.normalize, folder.max_seq_length, folder.prompts) == (None, False, None, {})


def test_the_router_of_an_asymmetric_model_is_refused_by_name(bert: Path, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.router import Router
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        router = Router.for_query_document(query_modules=[Transformer(str(bert)), Pooling(32)],
                                           document_modules=[Transformer(str(bert)), Pooling(32, "cls")])
        SentenceTransformer(modules=[router], device="cpu").save(str(tmp_path / "router"))
    with pytest.raises(ModelLoadError, match=r"module 0 \(\.: sentence_transformers\.base\.modules\.router\.Router\) "
                                             r"is not a module inferd runs"):
        load(tmp_path / "router")


@pytest.mark.parametrize(("types", "needle"), [
    (("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
      "sentence_transformers.models.LayerNorm"), r"module 2 \(2_m: sentence_transformers.models.LayerNorm\) is not"),
    (("custom_st.Transformer", "sentence_transformers.models.Pooling"), r"module 0 \(\.: custom_st.Transformer\)"),
    (("sentence_transformers.models.Transformer", "sentence_transformers.models.Dense",
      "sentence_transformers.models.Pooling"), "the modules are Transformer, Dense, Pooling"),
])
def test_modules_inferd_cannot_run_are_refused_by_name(tmp_path: Path, types: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ModelLoadError, match=needle):
        read_folder(write_modules(tmp_path, *types))


@pytest.mark.parametrize(("cfg", "needle"), [
    ({"pooling_mode": "splade"}, "unsupported pooling mode 'splade'"),
    ({"pooling_mode": ["mean", 3]}, "pooling_mode must be"),
    ({"pooling_mode": "mean", "include_prompt": "no"}, "include_prompt must be true or false"),
])
def test_a_wrong_pooling_config_is_named(tmp_path: Path, cfg: dict[str, Any], needle: str) -> None:
    with pytest.raises(ModelLoadError, match=f"1_Pooling/config.json: {needle}"):
        read_folder(pooling_folder(tmp_path, cfg))


def test_a_dense_activation_outside_torch_is_refused(bert: Path, tmp_path: Path) -> None:
    folder = write_st_legacy(tmp_path / "m", bert, dense=8, activation="my_package.Swish")
    with pytest.raises(ModelLoadError, match="activation function 'my_package.Swish' is not one inferd runs"):
        read_folder(folder)


def test_a_dense_of_the_wrong_width_is_refused(bert: Path, tmp_path: Path) -> None:
    folder = write_st_legacy(tmp_path / "m", bert, pooling=("mean",), dense=8)
    cfg = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**cfg, "pooling_mode_cls_token": True}))
    with pytest.raises(ModelLoadError, match=r"Dense module 2_Dense takes 32 values; pooling \(cls\+mean\) gives 64"):
        load(folder)


def test_st_config_prompts_default_and_similarity(tmp_path: Path) -> None:
    cfg = tmp_path / "config_sentence_transformers.json"
    cfg.write_text(json.dumps({"prompts": {"query": "query: ", "empty": None}, "default_prompt_name": "query",
                               "similarity_fn_name": "dot_product"}))
    folder = read_folder(tmp_path)
    assert (folder.prompts, folder.default_prompt_name, folder.similarity_fn_name) == (
        {"query": "query: ", "empty": ""}, "query", "dot")
    for data, needle in [({"prompts": {"q": "q"}, "default_prompt_name": "p"}, "default_prompt_name 'p'"),
                         ({"similarity_fn_name": "jaccard"}, "similarity_fn_name 'jaccard'"),
                         ({"model_type": "SparseEncoder"}, "model_type 'SparseEncoder'")]:
        cfg.write_text(json.dumps(data))
        with pytest.raises(ModelLoadError, match=needle):
            read_folder(tmp_path)


@pytest.mark.parametrize(("name", "content", "needle"), [
    ("modules.json", "[1,", "modules.json in the model folder cannot be read: not valid JSON"),
    ("modules.json", '{"a": 1}', "modules.json in the model folder must be a list of modules"),
    ("modules.json", '[{"type": 3}]', "modules.json: module 0 needs a 'type' and a 'path'"),
    ("config_sentence_transformers.json", '{"similarity_fn_name": ["dot"]}', "similarity_fn_name \\['dot'\\]"),
    ("config_sentence_transformers.json", '{"prompts": {"q": "q"}, "default_prompt_name": ["q"]}',
     "default_prompt_name \\['q'\\] is not one of its prompts"),
    ("config_sentence_transformers.json", '{"prompts": ["q"]}', "'prompts' must map names to prompt texts"),
])
def test_malformed_files_are_refused_by_name(tmp_path: Path, name: str, content: str, needle: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(ModelLoadError, match=needle):
        read_folder(tmp_path)


# -- a model's own prompts must fit the text limits ----------------------------------------------------------------


def test_a_prompt_longer_than_a_text_may_be_is_refused_at_load_naming_it(bert: Path, tmp_path: Path) -> None:
    folder = add_prompts(write_st_legacy(tmp_path / "m", bert), {"query": "q " * 100_000}, "query")
    with pytest.raises(ModelLoadError, match=r"prompt 'query' of config_sentence_transformers.json is 200000 "
                                             r"characters long.*\(20000, limits.max_chars_per_text\)"):
        load(folder)


def test_a_prompt_that_leaves_no_token_for_the_text_is_refused(bert: Path) -> None:
    from tokenizers import Tokenizer

    encoder = TextEncoder(Tokenizer.from_file(str(bert / "tokenizer.json")), 16, truncate=True)
    check_prompts({"ok": "the cat " * 6}, encoder, 20_000)  # 14 tokens with [CLS] [SEP]: one left for the text
    with pytest.raises(ModelLoadError, match="prompt 'long' .* is 15 tokens: with the model's limit of 16 tokens"):
        check_prompts({"ok": "", "long": "the cat " * 7}, encoder, 20_000)


# -- every file a load opens stays under the root ------------------------------------------------------------------


@pytest.fixture()
def rooted(bert: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    folder = Path(shutil.copytree(bert, root / "m"))
    (tmp_path / "outside" / "x").mkdir(parents=True)
    (tmp_path / "outside" / "x" / "config.json").write_text("{}")
    return root, folder


@pytest.mark.parametrize("path", ["../../outside/x", "/etc", "1_Pooling/../../m2"])
def test_a_module_path_that_leaves_the_folder_is_refused_as_written(rooted: tuple[Path, Path], path: str) -> None:
    root, folder = rooted
    modules = json.loads((folder / "modules.json").read_text())
    modules[1]["path"] = path
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="modules.json module 1: path .* leaves the model folder") as caught:
        check_confined(folder, root)
    assert "config.json" not in str(caught.value) and str(root) not in str(caught.value)


def test_a_weights_file_linked_out_of_the_root_is_refused_without_naming_its_target(
        rooted: tuple[Path, Path], tmp_path: Path) -> None:
    root, folder = rooted
    (tmp_path / "outside" / "w.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(tmp_path / "outside" / "w.safetensors")
    with pytest.raises(ModelLoadError, match="^model.safetensors in the model folder is a link that leads outside "
                                             "model.root") as caught:
        check_confined(folder, root)
    assert "outside" not in str(caught.value).replace("leads outside", "")


def test_links_inside_the_root_are_followed_and_checked(rooted: tuple[Path, Path], tmp_path: Path) -> None:
    root, folder = rooted
    # A hub-cache layout: the snapshot's files link to blobs beside it, under the same root.
    (root / "blobs").mkdir()
    os.replace(folder / "model.safetensors", root / "blobs" / "abc")
    (folder / "model.safetensors").symlink_to(Path("..") / "blobs" / "abc")
    check_confined(folder, root)
    # A linked module folder inside the root whose own file links out.
    shared = root / "shared_pooling"
    shared.mkdir()
    (shared / "config.json").symlink_to(tmp_path / "outside" / "x" / "config.json")
    shutil.rmtree(folder / "1_Pooling")
    (folder / "1_Pooling").symlink_to(shared)
    with pytest.raises(ModelLoadError, match="^1_Pooling/config.json in the model folder is a link"):
        check_confined(folder, root)


def test_a_pipe_in_place_of_a_file_is_refused(rooted: tuple[Path, Path]) -> None:
    root, folder = rooted
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # whoever opened it to read would wait for ever
    with pytest.raises(ModelLoadError, match="^config.json in the model folder is not a regular file"):
        check_confined(folder, root)


def test_a_link_into_another_allowed_root_is_followed(rooted: tuple[Path, Path], tmp_path: Path) -> None:
    root, folder = rooted
    store = tmp_path / "weights"  # a second model.root entry: a shared weights store
    store.mkdir()
    os.replace(folder / "model.safetensors", store / "w.safetensors")
    (folder / "model.safetensors").symlink_to(store / "w.safetensors")
    with pytest.raises(ModelLoadError, match="model.safetensors in the model folder is a link"):
        check_confined(folder, (root,))
    check_confined(folder, (root, store))


def test_a_spec_is_held_to_every_model_root_and_the_operator_s_own_folder_to_its_parent(tmp_path: Path) -> None:
    from inferd.core.spec import spec_from_settings
    from inferd.settings import Settings

    a, b, own = tmp_path / "a", tmp_path / "b", tmp_path / "own" / "m"
    settings = Settings.model_validate({"model": {"path": str(own), "root": [str(a), str(b)]}})
    assert spec_from_settings(settings, a / "m", "2").files_roots == (a.resolve(), b.resolve())
    assert spec_from_settings(settings).files_roots == (a.resolve(), b.resolve(), own.parent.resolve())


def test_a_sharded_index_naming_a_file_outside_the_folder_is_refused(rooted: tuple[Path, Path]) -> None:
    root, folder = rooted
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"embeddings.word_embeddings.weight": "../../outside/w.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json's weight_map: path '../../outside/w"):
        check_confined(folder, root)


def test_load_handler_holds_a_spec_to_its_root(rooted: tuple[Path, Path], tmp_path: Path) -> None:
    root, folder = rooted
    (tmp_path / "outside" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(tmp_path / "outside" / "tokenizer.json")
    spec = ModelSpec(path=folder, name="t", version="1", device="cpu", warmup=False, files_roots=(root,))
    with pytest.raises(ModelLoadError, match="tokenizer.json in the model folder is a link"):
        load_handler(spec)
    # The folder's parent is the root when a spec names none (a load built outside the server's settings).
    with pytest.raises(ModelLoadError, match="tokenizer.json in the model folder is a link"):
        load_handler(ModelSpec(path=folder, name="t", version="1", device="cpu", warmup=False))
