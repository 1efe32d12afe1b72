"""Decoder models on tiny random Qwen3-shaped folders, against the references users compare with.

A Qwen3-Embedding-shaped folder (last-token pooling, the EOS its tokenizer appends, Normalize, a query prompt)
equals ``SentenceTransformer.encode``; a Qwen3-Reranker-shaped causal LM equals its model card's P(yes); a
reranker converted to ``Qwen3ForSequenceClassification`` equals ``CrossEncoder.predict`` (all within 1e-5, texts
of very different lengths batched together), on torch and through their ONNX Runtime and OpenVINO exports
(within 1e-4, the gate passed). An architecture inferd does not list is refused at load, naming the list.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import Server
from decoders import (
    QUERY_PROMPT,
    model_card_scores,
    write_qwen3_embedder,
    write_qwen3_reranker,
    write_qwen3_seq_cls,
)
from tinymodel import WORDS, write_tiny_bert

from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.preprocess import InputError
from inferd.core.spec import ModelSpec
from inferd.core.tasks.handlers import detect_task
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions

TOL = 1e-5


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decoders")
    write_qwen3_embedder(root / "embedder", seed=1)
    write_qwen3_reranker(root / "llm-reranker", seed=2)
    write_qwen3_reranker(root / "llm-reranker-tied", seed=3, tied=True)
    write_qwen3_seq_cls(root / "seq-cls", seed=4)
    return root


def _handler(path: Path, **kw: Any) -> Any:
    return load_handler(ModelSpec(path, "1", name="x", device="cpu", warmup=False, **kw))


def _outputs(handler: Any, inputs: list[Any], prompt: str = "") -> np.ndarray:
    # A prompt as admission adds it: prepended to each text, and said in the texts' options.
    options = InputOptions(TextOptions(prompt=prompt)) if prompt else PLAIN_INPUTS
    texts = [prompt + t for t in inputs] if prompt else inputs
    return np.array(handler.postprocess(handler.infer(handler.preprocess(texts, options))))


TEXTS = [_sentence(random.Random(i), n) for i, n in enumerate((1, 4, 17, 60, 110))]


@pytest.mark.parametrize("prompt", [None, "query"])
def test_the_decoder_embedder_equals_sentence_transformers(root: Path, prompt: str | None) -> None:
    from sentence_transformers import SentenceTransformer

    handler = _handler(root / "embedder")
    assert handler.pooling == "lasttoken" and handler.normalize
    got = _outputs(handler, TEXTS, QUERY_PROMPT if prompt else "")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(root / "embedder"), device="cpu")
    # sentence-transformers pads on the tokenizer's side (left here); inferd pads on the right: equal.
    assert model.tokenizer.padding_side == "left"
    expected = model.encode(TEXTS, prompt_name=prompt, batch_size=len(TEXTS), convert_to_numpy=True)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    # The EOS the tokenizer appends is the pooled token.
    assert all(e.ids[-1] == handler.pad_id for e in handler.preprocess(TEXTS))


def test_a_causal_lm_without_sentence_transformers_files_pools_its_last_token(root: Path, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = shutil.copytree(root / "embedder", tmp_path / "bare")
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (folder / name).unlink()
    for sub in ("1_Pooling", "2_Normalize"):
        shutil.rmtree(folder / sub)
    assert detect_task(folder) == "rerank"  # a bare causal LM is an LLM reranker unless told otherwise
    handler = _handler(folder, task="embedding")
    assert handler.pooling == "lasttoken" and not handler.normalize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no sentence-transformers model found, creating one"
        expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=len(TEXTS))
    np.testing.assert_allclose(_outputs(handler, TEXTS), expected, atol=TOL, rtol=0)


# Every decoder family the architecture list names (core/families.py), beside Qwen3 above; and Qwen3 again with a
# tokenizer that pads on the right (sentence-transformers then pools the last token before the padding).
@pytest.mark.parametrize(("kind", "side"), [("qwen2", "left"), ("llama", "left"), ("mistral", "left"),
                                            ("gemma", "left"), ("gemma2", "left"), ("gemma3_text", "left"),
                                            ("qwen3", "right")])
def test_each_listed_decoder_family_embeds_as_sentence_transformers(tmp_path: Path, kind: str, side: str) -> None:
    from sentence_transformers import SentenceTransformer

    folder = write_qwen3_embedder(tmp_path / kind, seed=9, model_type=kind, v6_pooling=True, padding_side=side)
    got = _outputs(_handler(folder), TEXTS, QUERY_PROMPT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(folder), device="cpu")
    assert model.tokenizer.padding_side == side
    expected = model.encode(TEXTS, prompt_name="query", batch_size=len(TEXTS), convert_to_numpy=True)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llm-reranker", "llm-reranker-tied"])
def test_the_llm_reranker_equals_its_model_card(root: Path, name: str) -> None:
    assert detect_task(root / name) == "rerank"
    handler = _handler(root / name)
    assert handler.loaded.facts.other["scoring"] == "llm-yes-no"
    rng = random.Random(5)
    pairs = [("which river runs past the city", _sentence(rng, n)) for n in (1, 6, 30, 90)]
    pairs.append(("a dog", "the cat"))
    got = _outputs(handler, pairs)
    np.testing.assert_allclose(got[:, 0], model_card_scores(root / name, pairs), atol=TOL, rtol=0)
    # The raw score is the log-odds of "yes" over "no": its sigmoid is the score.
    np.testing.assert_allclose(1 / (1 + np.exp(-got[:, 1])), got[:, 0], atol=1e-6, rtol=0)


def test_the_llm_rerankers_instruction_is_a_setting(root: Path) -> None:
    instruction = "Given a question about animals, find the passage that names the animal"
    handler = _handler(root / "llm-reranker", rerank_instruction=instruction)
    pairs = [("a dog", "the cat"), ("which river", _sentence(random.Random(12), 20))]
    np.testing.assert_allclose(_outputs(handler, pairs)[:, 0],
                               model_card_scores(root / "llm-reranker", pairs, instruction=instruction),
                               atol=TOL, rtol=0)
    assert not np.allclose(_outputs(handler, pairs)[:, 0], model_card_scores(root / "llm-reranker", pairs))
    with pytest.raises(ModelLoadError, match="a cross-encoder takes no instruction"):
        _handler(root / "seq-cls", rerank_instruction=instruction)


def test_a_causal_lm_of_another_family_is_not_scored_with_qwens_template(tmp_path: Path) -> None:
    folder = write_qwen3_reranker(tmp_path / "llama", model_type="llama")
    assert detect_task(folder) == "rerank"
    with pytest.raises(ModelLoadError, match=r"follows Qwen3-Reranker's chat template, for qwen2, qwen3 models; "
                                             r"this one is 'llama'"):
        _handler(folder)


def test_a_sentence_transformers_cross_encoder_folder_over_a_causal_lm_is_refused(root: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(root / "llm-reranker", tmp_path / "logit-score")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore",
         "type": "sentence_transformers.cross_encoder.modules.LogitScore"}]))
    with pytest.raises(ModelLoadError, match=r"CrossEncoder folder over a causal LM \(modules.json\) is not read"):
        _handler(folder)


def test_a_pair_past_the_limit_loses_its_document_end_as_the_model_card_cuts_it(root: Path) -> None:
    handler = _handler(root / "llm-reranker", max_seq_length=96)
    pairs = [("a dog", _sentence(random.Random(6), 200)), ("a dog", "the cat")]
    encoded = handler.preprocess(pairs)
    assert encoded[0].tokens == 96 and encoded[0].truncated and not encoded[1].truncated
    np.testing.assert_allclose(_outputs(handler, pairs)[:, 0],
                               model_card_scores(root / "llm-reranker", pairs, max_length=96), atol=TOL, rtol=0)


def test_a_query_that_leaves_no_room_for_a_document_is_refused_naming_the_limit(root: Path) -> None:
    # The card cuts the formatted pair's end: such a query cut every document away, and every one scored alike.
    handler = _handler(root / "llm-reranker", max_seq_length=96)
    crowded = _sentence(random.Random(9), 120)
    with pytest.raises(InputError, match=r"the query leaves no room for a document: .* the model's limit of 96 "
                                         r"\(max_seq_length\)") as caught:
        handler.preprocess([("a dog", "the cat"), (crowded, "the cat"), (crowded, "a dog")])
    assert (caught.value.index, caught.value.code) == (1, "context_length_exceeded")
    assert handler.preprocess([(_sentence(random.Random(10), 3), "the cat")])[0].tokens < 96


@pytest.mark.parametrize("tokenizer_pad", [None, "<|im_end|>"])
def test_a_converted_sequence_classifier_equals_the_cross_encoder(root: Path, tmp_path: Path,
                                                                  tokenizer_pad: str | None) -> None:
    from sentence_transformers import CrossEncoder

    folder = root / "seq-cls"
    if tokenizer_pad is not None:
        # A tokenizer padding with another id than the config's pad_token_id, by which the head finds each row's
        # last token: the batch must be padded with the config's.
        folder = shutil.copytree(folder, tmp_path / "other-pad")
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "pad_token": tokenizer_pad}))
    assert detect_task(folder) == "rerank"
    handler = _handler(folder)
    rng = random.Random(7)
    pairs = [("which river runs past the city", _sentence(rng, n)) for n in (1, 6, 30, 90)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = CrossEncoder(str(folder), device="cpu").predict(pairs, batch_size=len(pairs))
    np.testing.assert_allclose(_outputs(handler, pairs)[:, 0], expected, atol=TOL, rtol=0)


def test_a_decoder_sequence_classifier_without_a_padding_id_is_refused(root: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(root / "seq-cls", tmp_path / "no-pad")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["pad_token_id"] = None
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="needs pad_token_id"):
        _handler(folder)


@pytest.mark.parametrize(("change", "match"), [
    ({"model_type": "gpt2"}, r"model_type 'gpt2' is not a supported architecture; supported: bert, .*qwen3"),
    ({"model_type": "nomic_bert", "auto_map": {"AutoModel": "modeling_hf_nomic_bert.NomicBertModel"}},
     r"its own code \(config.json auto_map: AutoModel\).*trust_remote_code"),
])
def test_an_unlisted_architecture_is_refused_at_load_naming_the_list(tmp_path: Path, change: dict[str, Any],
                                                                      match: str) -> None:
    folder = write_tiny_bert(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError, match=match):
        _handler(folder)


# The exported graphs: every batch shape of the gate passed, and the answers equal the references within 1e-4.
GRAPH_TOL = 1e-4


def _exported(path: Path, backend: str, cache: Path) -> Any:
    handler = _handler(path, backend=backend, cache_dir=str(cache), gate={"texts": 32})
    assert handler.loaded.backend == backend and handler.loaded.backend_info["gate"]["passed"]
    return handler


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_the_decoder_embedder_exports_equal_to_sentence_transformers(root: Path, tmp_path: Path,
                                                                    backend: str) -> None:
    from sentence_transformers import SentenceTransformer

    handler = _exported(root / "embedder", backend, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(root / "embedder"), device="cpu")
    expected = model.encode(TEXTS, prompt_name="query", batch_size=len(TEXTS), convert_to_numpy=True)
    np.testing.assert_allclose(_outputs(handler, TEXTS, QUERY_PROMPT), expected, atol=GRAPH_TOL, rtol=0)
    for i in (0, 4):  # alone as among texts of very different lengths
        np.testing.assert_allclose(_outputs(handler, TEXTS[i: i + 1], QUERY_PROMPT)[0], expected[i], atol=GRAPH_TOL,
                                   rtol=0)


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_the_llm_reranker_exported_equals_its_model_card(root: Path, tmp_path: Path, backend: str) -> None:
    handler = _exported(root / "llm-reranker", backend, tmp_path)
    pairs = [("which river runs past the city", _sentence(random.Random(10), n)) for n in (1, 6, 30, 90)]
    np.testing.assert_allclose(_outputs(handler, pairs)[:, 0], model_card_scores(root / "llm-reranker", pairs),
                               atol=GRAPH_TOL, rtol=0)


def test_a_converted_sequence_classifier_on_onnx_equals_the_cross_encoder(root: Path, tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    handler = _exported(root / "seq-cls", "onnx", tmp_path)
    pairs = [("which river runs past the city", _sentence(random.Random(11), n)) for n in (1, 6, 30, 90)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = CrossEncoder(str(root / "seq-cls"), device="cpu").predict(pairs, batch_size=len(pairs))
    np.testing.assert_allclose(_outputs(handler, pairs)[:, 0], expected, atol=GRAPH_TOL, rtol=0)


@pytest.mark.parametrize("name", ["embedder", "llm-reranker"])
def test_a_decoder_on_openvino_bf16_is_served_only_through_its_gate(root: Path, tmp_path: Path, name: str) -> None:
    try:
        handler = _handler(root / name, backend="openvino", dtype="bfloat16", cache_dir=str(tmp_path),
                           gate={"texts": 32})
    except ModelLoadError as exc:  # refused: the message names the figures that missed their bounds
        assert "Figures against torch fp32" in str(exc), str(exc)
        return
    assert handler.loaded.backend_info["gate"]["passed"] and handler.loaded.backend_info["gate"]["kind"] == "half"
    if name == "embedder":
        got = _outputs(handler, TEXTS)
        want = _outputs(_handler(root / name), TEXTS)
        assert np.isfinite(got).all() and ((got * want).sum(axis=1) >= 0.99).all()  # unit vectors
    else:
        pairs = [("which river runs past the city", _sentence(random.Random(12), n)) for n in (1, 6, 30, 90)]
        scores = _outputs(handler, pairs)[:, 0]
        assert np.isfinite(scores).all()
        assert np.abs(scores - model_card_scores(root / name, pairs)).max() <= 0.05  # a probability, bf16-rounded


@pytest.fixture(scope="module")
def llm_reranker(root: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(root / "llm-reranker"), "INFERD__MODEL__LOAD_MODE": "eager",
        "INFERD__CACHE__MAX_ENTRIES": "0"}, wait="/health/ready")


def test_the_llm_reranker_serves_tei_rerank(llm_reranker: Server, root: Path) -> None:
    rng = random.Random(8)
    docs = [_sentence(rng, n) for n in (2, 12, 40, 100)]
    r = httpx.post(llm_reranker.url + "/rerank", json={"query": "the cat", "texts": docs, "raw_scores": False},
                   timeout=60)
    assert r.status_code == 200, r.text
    got = {item["index"]: item["score"] for item in r.json()}
    expected = model_card_scores(root / "llm-reranker", [("the cat", d) for d in docs])
    np.testing.assert_allclose([got[i] for i in range(len(docs))], expected, atol=TOL, rtol=0)
    info = httpx.get(llm_reranker.url + "/info").json()
    assert info["task"] == "rerank" and info["max_seq_length"] == 256
