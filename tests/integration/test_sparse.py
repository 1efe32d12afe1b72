"""Sparse and multi-vector outputs on tiny random models (issue 32): a SPLADE folder saved by sentence-transformers'
SparseEncoder equals ``SparseEncoder.encode``; a bge-m3-shaped folder (XLM-RoBERTa + sparse_linear.pt +
colbert_linear.pt) equals BAAI's formulas, written out below on the bare transformers model, for any subset of its
three outputs from one pass; its heads are read as plain tensors only."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.outputs import TextOutputs
from inferd.core.preprocess import InputError
from inferd.core.spec import ModelSpec
from inferd.core.tasks.m3 import M3Handler
from inferd.core.tasks.sparse import SparseHandler
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions
from tests.tinymodel import _tiny_encoder_config, write_tiny_bert

TEXTS = ["hello world", "the cat and the dog run to the river in the city", "a", "yes no yes no yes",
         "我你他 model service"]


def _splade(root: Path) -> dict[str, Path]:
    """The same tiny BertForMaskedLM saved by SparseEncoder as sentence-transformers 6 writes it (Transformer with
    transformer_task fill-mask) and as 5 did (MLMTransformer)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import BertForMaskedLM

    hf = root / "mlm-hf"
    config = _tiny_encoder_config(hf, 3, 32, 2, 64)
    BertForMaskedLM(config).eval().save_pretrained(hf)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = {"v6": Transformer(str(hf), transformer_task="fill-mask"), "v5": MLMTransformer(str(hf))}
        for name, module in modules.items():
            model = SparseEncoder(modules=[module, SpladePooling("max")], device="cpu")
            model.save(str(root / f"splade-{name}"), create_model_card=False)
            out[name] = root / f"splade-{name}"
    return out


def _m3(root: Path) -> Path:
    """bge-m3's layout, tiny: an XLM-RoBERTa encoder, a tokenizer whose cls, eos, pad and unk are special, and its two
    heads as torch-saved state dicts."""
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

    folder = write_tiny_bert(root / "m3", seed=4)
    for name in ("modules.json", "sentence_bert_config.json", "model.safetensors", "config.json"):
        (folder / name).unlink()
    for sub in ("1_Pooling", "2_Normalize"):
        shutil.rmtree(folder / sub, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"eos_token": "[SEP]", "bos_token": "[CLS]"})
    tokenizer.save_pretrained(folder)
    torch.manual_seed(4)
    config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=130, type_vocab_size=1, pad_token_id=0,
                              initializer_range=0.2)
    XLMRobertaModel(config).eval().save_pretrained(folder)
    torch.save(torch.nn.Linear(32, 1).state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(32, 24).state_dict(), folder / "colbert_linear.pt")
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sparse")
    _splade(root)
    _m3(root)
    return root


def _load(kind: type, folder: Path, **settings: Any) -> Any:
    """Loaded as a server loads it: the folder (or model.pooling) decides the handler."""
    handler = load_handler(ModelSpec(folder, "1", device="cpu", warmup=False, **settings))
    assert type(handler) is kind
    return handler


def _run(handler: Any, texts: list[Any], options: InputOptions = PLAIN_INPUTS) -> list[Any]:
    return handler.postprocess(handler.infer(handler.preprocess(texts, options)))


@pytest.mark.parametrize("form", ["v6", "v5"])
def test_splade_equals_sparse_encoder(root: Path, form: str) -> None:
    from sentence_transformers import SparseEncoder

    folder = root / f"splade-{form}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = SparseEncoder(str(folder), device="cpu").encode(TEXTS, convert_to_sparse_tensor=True).to_dense().numpy()
    handler = _load(SparseHandler, folder)
    batched = _run(handler, TEXTS)
    alone = [_run(handler, [t])[0] for t in TEXTS]
    for row, b, a in zip(want, batched, alone, strict=True):
        ids = np.flatnonzero(row)
        for got in (b.sparse, a.sparse):  # among texts of other lengths (padded), and alone
            np.testing.assert_array_equal(got.indices, ids)
            np.testing.assert_allclose(got.values, row[ids], atol=1e-5, rtol=0)
        vocab = handler.tokenizer.id_to_token
        assert b.sparse.tokens == tuple(vocab(int(i)) for i in ids)
    assert handler.loaded.facts.other["outputs"] == ["sparse"]


def test_splade_prunes_as_configured_and_serves_a_bare_masked_lm_by_setting(root: Path) -> None:
    whole = _run(_load(SparseHandler, root / "splade-v6"), TEXTS)
    pruned = _run(_load(SparseHandler, root / "splade-v6", sparse_top_k=3, sparse_threshold=0.05), TEXTS)
    for full, cut in zip(whole, pruned, strict=True):
        keep = full.sparse.values > 0.05
        heaviest = np.sort(full.sparse.indices[keep][np.argsort(-full.sparse.values[keep], kind="stable")[:3]])
        np.testing.assert_array_equal(cut.sparse.indices, heaviest)
        assert len(cut.sparse) <= 3
    # The same weights from the bare masked-LM folder (no sentence-transformers files), by model.pooling: splade.
    bare = _run(_load(SparseHandler, root / "mlm-hf", pooling="splade"), TEXTS)
    for a, b in zip(whole, bare, strict=True):
        np.testing.assert_array_equal(a.sparse.indices, b.sparse.indices)
        np.testing.assert_allclose(a.sparse.values, b.sparse.values, atol=1e-6, rtol=0)


def _m3_reference(folder: Path, text: str) -> dict[str, Any]:
    """BAAI's formulas on the bare model, one text, no padding."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    sparse_linear, colbert_linear = torch.nn.Linear(32, 1), torch.nn.Linear(32, 24)
    sparse_linear.load_state_dict(torch.load(folder / "sparse_linear.pt"))
    colbert_linear.load_state_dict(torch.load(folder / "colbert_linear.pt"))
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        weights = torch.relu(sparse_linear(hidden))[:, 0]
        colbert = torch.nn.functional.normalize(colbert_linear(hidden[1:]), dim=-1)
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    lexical: dict[int, float] = {}
    for i, w in zip(ids[0].tolist(), weights.tolist(), strict=True):
        if i not in unused and w > 0:
            lexical[i] = max(lexical.get(i, 0.0), w)
    return {"dense": torch.nn.functional.normalize(hidden[0], dim=-1).numpy(), "sparse": lexical,
            "multivector": colbert.numpy()}


def test_m3_gives_any_subset_of_its_outputs_as_baai_computes_them(root: Path) -> None:
    folder = root / "m3"
    handler = _load(M3Handler, folder)
    assert handler.loaded.facts.other["outputs"] == ["dense", "sparse", "multivector", "token_states"]
    subsets = [("dense", "sparse", "multivector"), ("sparse",), ("multivector", "dense"), ("sparse", "multivector")]
    asks = InputOptions(each=tuple(TextOptions(outputs=subsets[i % len(subsets)]) for i in range(len(TEXTS))))
    got = _run(handler, TEXTS, asks)  # one batch, one pass, every text its own subset
    for text, ask, out in zip(TEXTS, asks.per_text(len(TEXTS)), got, strict=True):
        want = _m3_reference(folder, text)
        assert isinstance(out, TextOutputs) and out.kinds == tuple(k for k in ("dense", "sparse", "multivector")
                                                                     if k in ask.outputs)
        if out.dense is not None:
            np.testing.assert_allclose(out.dense, want["dense"], atol=1e-5, rtol=0)
        if out.sparse is not None:
            assert out.sparse.indices.tolist() == sorted(want["sparse"])
            np.testing.assert_allclose(out.sparse.values, [want["sparse"][i] for i in sorted(want["sparse"])],
                                       atol=1e-5, rtol=0)
        if out.multivector is not None:
            assert out.multivector.shape == want["multivector"].shape  # every token after the first, eos included
            np.testing.assert_allclose(out.multivector, want["multivector"], atol=1e-5, rtol=0)
    # A text that asks for nothing gets its dense vector, as every embedding route takes it.
    plain = _run(handler, TEXTS[:2])
    np.testing.assert_allclose(plain[1], _m3_reference(folder, TEXTS[1])["dense"], atol=1e-5, rtol=0)


def test_m3_heads_are_read_as_plain_tensors_only(root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m3-pickled"
    shutil.copytree(root / "m3", folder)
    # A whole module pickled: loading it would import and build a class the file names.
    torch.save(torch.nn.Linear(32, 1), folder / "sparse_linear.pt")
    with pytest.raises(ModelLoadError, match="sparse_linear.pt cannot be read as weights"):
        _load(M3Handler, folder)
    (folder / "sparse_linear.pt").unlink()
    from safetensors.torch import save_file

    save_file({"weight": torch.randn(1, 16)}, str(folder / "sparse_linear.safetensors"))
    with pytest.raises(ModelLoadError, match="taking the model's 32 hidden values"):
        _load(M3Handler, folder)


def test_bge_m3_heads_over_a_decoder_are_refused(root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m3-decoder"
    shutil.copytree(root / "m3", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen3", "architectures": ["Qwen3Model"]}))
    with pytest.raises(ModelLoadError, match="bge-m3's heads over an encoder; this model is a Qwen2 / Qwen3 decoder"):
        _load(M3Handler, folder)


def test_an_output_the_model_lacks_is_refused_by_name(root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m3-sparse-only"
    shutil.copytree(root / "m3", folder)
    (folder / "colbert_linear.pt").unlink()
    handler = _load(M3Handler, folder)
    assert handler.loaded.facts.other["outputs"] == ["dense", "sparse", "token_states"]
    with pytest.raises(InputError, match="asks for multivector; this model gives dense, sparse, token_states"):
        handler.preprocess(["hello", "world"], InputOptions(each=(TextOptions(outputs=("dense",)),
                                                                  TextOptions(outputs=("multivector",)))))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "xlm-roberta"


# Each head on one runtime (an export and its gate cost tens of seconds on two shared cores): the same exporter
# serves both, and test_multivector.py exports the ColBERT projection to OpenVINO.
@pytest.mark.parametrize(("backend", "kind"), [("onnx", SparseHandler), ("openvino", M3Handler)])
def test_the_heads_run_inside_the_exported_graph_behind_the_gate(root: Path, tmp_path_factory: pytest.TempPathFactory,
                                                                 backend: str, kind: type) -> None:
    """SPLADE's pooling and bge-m3's two heads are exported with the encoder: the converted model's outputs equal
    torch's, and the gate judged each output (term agreement, weight difference, MaxSim ranking) and passed it."""
    cache = tmp_path_factory.mktemp(f"cache-{backend}")
    folder, asks = ((root / "splade-v6", ("sparse",)) if kind is SparseHandler
                    else (root / "m3", ("dense", "sparse", "multivector")))
    torch_handler = _load(kind, folder)
    converted = _load(kind, folder, backend=backend, cache_dir=str(cache), gate={"texts": 32})
    gate = converted.loaded.backend_info["gate"]
    assert gate["passed"] and gate["figures"]["sparse_top10"] == 1.0
    assert gate["figures"]["weight_diff_max"] < 1e-4
    assert (gate["figures"]["maxsim_spearman"] is None) == (kind is SparseHandler)
    chosen = InputOptions(TextOptions(outputs=asks))  # as a request's ``outputs`` reach the handler
    for want, got in zip(_run(torch_handler, TEXTS, chosen), _run(converted, TEXTS, chosen), strict=True):
        np.testing.assert_array_equal(got.sparse.indices, want.sparse.indices)
        np.testing.assert_allclose(got.sparse.values, want.sparse.values, atol=1e-4, rtol=0)
        if kind is M3Handler:
            np.testing.assert_allclose(got.dense, want.dense, atol=1e-4, rtol=0)
            np.testing.assert_allclose(got.multivector, want.multivector, atol=1e-4, rtol=0)
