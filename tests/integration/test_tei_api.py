"""text-embeddings-inference's HTTP API on real servers with tiny random models, against sentence-transformers.

Vectors equal ``SentenceTransformer.encode(..., prompt_name=..., truncate_dim=...)`` (≤ 1e-5); /similarity
equals their cosines; /tokenize and /decode equal the model's tokenizer; TEI's /predict equals the
classification and rerank tasks' own answers; every refusal on every TEI route (``/rerank`` and ``POST /``
included) is in TEI's error shape with inferd's statuses; a model with ``include_prompt: false`` pools without
the prompt's tokens, as sentence-transformers does; a left cut keeps the prompt; a rerank pair takes
``truncate`` and ``truncation_direction`` (its document's start cut, as ``CrossEncoder`` with its tokenizer's
``truncation_side`` left scores it).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import Server
from prompted import PROMPTS, add_matryoshka_card, add_prompts, exclude_prompt_from_pooling, sentence_transformer
from tinymodel import WORDS, write_tiny_bert
from tokenizers import Tokenizer

from .conftest import task_env

TOL = 1e-5
TEXTS = ["hello world", "the cat is in the house", "你好世界", "a long text " + " ".join(WORDS[:40])]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tei-models")
    add_matryoshka_card(add_prompts(write_tiny_bert(root / "mrl", seed=21)))
    # CLS pooling, no normalisation, prompts left out of pooling, no Matryoshka card.
    exclude_prompt_from_pooling(add_prompts(write_tiny_bert(root / "instr", seed=22, pooling="cls",
                                                            normalize=False), default="query"))
    return root


@pytest.fixture(scope="module")
def mrl(root: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve(task_env(root / "mrl"), wait="/health/ready")


@pytest.fixture(scope="module")
def instr(root: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve(task_env(root / "instr"), wait="/health/ready")


@pytest.fixture(scope="module")
def st_mrl(root: Path) -> Any:
    return sentence_transformer(root / "mrl")


def _post(server: Server, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def _tei_error(r: httpx.Response, status: int, error_type: str, *words: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    assert isinstance(body["error"], str) and all(w in body["error"] for w in words), body
    return body["error"]


# -- /embed ------------------------------------------------------------------------------------------------


def test_embed_equals_sentence_transformers_for_one_text_and_many(mrl: Server, st_mrl: Any) -> None:
    want = st_mrl.encode(TEXTS)
    got = _post(mrl, "/embed", {"inputs": TEXTS})
    assert got.status_code == 200, got.text
    np.testing.assert_allclose(np.array(got.json()), want, atol=TOL)
    one = _post(mrl, "/embed", {"inputs": TEXTS[1]}).json()
    assert len(one) == 1  # TEI answers a list of vectors for a single text too
    np.testing.assert_allclose(one[0], want[1], atol=TOL)


def test_prompt_name_prepends_the_prompt_as_sentence_transformers_does(mrl: Server, st_mrl: Any) -> None:
    for name in ("query", "document"):
        got = _post(mrl, "/embed", {"inputs": TEXTS, "prompt_name": name}).json()
        np.testing.assert_allclose(np.array(got), st_mrl.encode(TEXTS, prompt_name=name), atol=TOL)
    plain = np.array(_post(mrl, "/embed", {"inputs": TEXTS}).json())
    assert np.abs(plain - np.array(got)).max() > 1e-3  # the prompt changed the vectors
    error = _tei_error(_post(mrl, "/embed", {"inputs": "x", "prompt_name": "nope"}), 422, "validation", "nope")
    # TEI's wording: its clients (tei-client's prompt_names) read the list from it.
    assert 'Available prompts: ["classification","document","query"]' in error


def test_dimensions_cut_a_matryoshka_model_and_renormalise(mrl: Server, st_mrl: Any) -> None:
    for d in (8, 16):
        got = np.array(_post(mrl, "/embed", {"inputs": TEXTS, "dimensions": d, "prompt_name": "query"}).json())
        want = st_mrl.encode(TEXTS, prompt_name="query", truncate_dim=d, normalize_embeddings=True)
        assert got.shape == (len(TEXTS), d)
        np.testing.assert_allclose(got, want, atol=TOL)
    _tei_error(_post(mrl, "/embed", {"inputs": "x", "dimensions": 12}), 422, "validation", "[8, 16]", "12")
    _tei_error(_post(mrl, "/embed", {"inputs": "x", "dimensions": 64}), 422, "validation", "32-dimensional")
    _tei_error(_post(mrl, "/embed", {"inputs": "x", "normalize": False}), 422, "validation", "normalize")


def test_truncate_false_refuses_a_long_text_and_the_left_cut_keeps_the_prompt(mrl: Server, st_mrl: Any,
                                                                              root: Path) -> None:
    rng = random.Random(3)
    words = [rng.choice(WORDS) for _ in range(300)]  # one token each: 302 tokens, the limit is 128
    text = " ".join(words)
    _tei_error(_post(mrl, "/embed", {"inputs": ["ok", text], "truncate": False}), 422, "validation",
               "inputs[1]", "128 tokens")
    right = np.array(_post(mrl, "/embed", {"inputs": text, "truncate": True}).json())[0]
    np.testing.assert_allclose(right, st_mrl.encode(text), atol=TOL)
    # Left: the end of the text is kept, after the prompt, as if the prompt had been written before it.
    tok = Tokenizer.from_file(str(root / "mrl" / "tokenizer.json"))
    n_prompt = len(tok.encode(PROMPTS["query"], add_special_tokens=False).ids)
    kept = " ".join(words[-(128 - 2 - n_prompt):])
    left = np.array(_post(mrl, "/embed", {"inputs": text, "truncate": True, "truncation_direction": "Left",
                                          "prompt_name": "query"}).json())[0]
    np.testing.assert_allclose(left, st_mrl.encode(kept, prompt_name="query"), atol=TOL)
    # Without a prompt the left cut is the tokenizer's own (sentence-transformers with truncation_side left).
    st_mrl.tokenizer.truncation_side = "left"
    try:
        want = st_mrl.encode(text)
    finally:
        st_mrl.tokenizer.truncation_side = "right"
    got = np.array(_post(mrl, "/embed", {"inputs": text, "truncation_direction": "left"}).json())[0]
    np.testing.assert_allclose(got, want, atol=TOL)


def test_prompt_left_out_of_pooling_cls_and_no_normalisation(instr: Server, root: Path) -> None:
    model = sentence_transformer(root / "instr")
    assert model.default_prompt_name == "query"
    # Default prompt applied, its tokens left out of the (CLS) pooling: the first token after the prompt.
    got = np.array(_post(instr, "/embed", {"inputs": TEXTS, "normalize": False}).json())
    want = model.encode(TEXTS)
    np.testing.assert_allclose(got, want, atol=TOL)
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() > 1e-3  # not unit length: the model does not normalise
    doc = np.array(_post(instr, "/embed", {"inputs": TEXTS, "normalize": False, "prompt_name": "document"}).json())
    np.testing.assert_allclose(doc, model.encode(TEXTS, prompt_name="document"), atol=TOL)
    # TEI's default normalize: true gives the same directions at unit length.
    unit = np.array(_post(instr, "/embed", {"inputs": TEXTS}).json())
    np.testing.assert_allclose(unit, want / np.linalg.norm(want, axis=1, keepdims=True), atol=TOL)
    _tei_error(_post(instr, "/embed", {"inputs": "x", "dimensions": 16}), 422, "validation",
               "no Matryoshka sizes")


# -- /similarity, /tokenize, /decode -------------------------------------------------------------------------


def test_similarity_is_the_cosine_of_the_vectors(mrl: Server, st_mrl: Any) -> None:
    source, others = "the cat runs", ["a dog walks", "the cat runs fast", "你好"]
    got = _post(mrl, "/similarity", {"inputs": {"source_sentence": source, "sentences": others}})
    assert got.status_code == 200, got.text
    v = st_mrl.encode([source, *others], prompt_name="query")
    prompted = _post(mrl, "/similarity", {"inputs": {"source_sentence": source, "sentences": others},
                                          "parameters": {"prompt_name": "query"}}).json()
    np.testing.assert_allclose(prompted, v[1:] @ v[0], atol=TOL)
    plain = st_mrl.encode([source, *others])
    np.testing.assert_allclose(got.json(), plain[1:] @ plain[0], atol=TOL)
    _tei_error(_post(mrl, "/similarity", {"inputs": {"source_sentence": "x", "sentences": ["ok", " "]}}), 422,
               "empty", "inputs.sentences[1]")
    _tei_error(_post(mrl, "/similarity", {"inputs": {"source_sentence": "", "sentences": ["ok"]}}), 422, "empty",
               "inputs.source_sentence")


def test_tokenize_and_decode_as_the_tokenizer_with_byte_offsets(mrl: Server, root: Path) -> None:
    tok = Tokenizer.from_file(str(root / "mrl" / "tokenizer.json"))
    text = "hello 你好 world"
    got = _post(mrl, "/tokenize", {"inputs": [text, "cat"], "prompt_name": "query"})
    assert got.status_code == 200, got.text
    rows = got.json()
    assert [t["id"] for t in rows[0]] == tok.encode(PROMPTS["query"] + text).ids
    assert rows[0][0] == {"id": 2, "text": "[CLS]", "special": True, "start": None, "stop": None}
    raw = (PROMPTS["query"] + text).encode()
    for t in rows[0][1:-1]:
        assert raw[t["start"]: t["stop"]].decode() == t["text"]  # offsets are bytes of the prompted input
    ni = next(t for t in rows[0] if t["text"] == "你")
    assert ni["stop"] - ni["start"] == 3
    bare = _post(mrl, "/tokenize", {"inputs": "cat", "add_special_tokens": False}).json()
    assert [t["id"] for t in bare[0]] == tok.encode("cat", add_special_tokens=False).ids
    ids = tok.encode("the cat is in the house").ids
    assert _post(mrl, "/decode", {"ids": ids}).json() == [tok.decode(ids)]
    assert _post(mrl, "/decode", {"ids": [ids, ids[:3]], "skip_special_tokens": False}).json() == [
        tok.decode(ids, skip_special_tokens=False), tok.decode(ids[:3], skip_special_tokens=False)]
    _tei_error(_post(mrl, "/decode", {"ids": [1, 10**9]}), 422, "validation", "ids[1]")
    # Beyond 64 bits the JSON parser reads a float; the refusal still says the integer the client sent.
    big = _tei_error(_post(mrl, "/decode", {"ids": [[1], [2, 2**64 + 1]]}), 422, "validation", "ids[1][1]: ")
    assert big.startswith(f"ids[1][1]: {2**64 + 1} is not a token id"), big
    _tei_error(_post(mrl, "/decode", {"ids": []}), 422, "empty", "ids")
    _tei_error(_post(mrl, "/tokenize", {"inputs": "x", "prompt_name": "nope"}), 422, "validation",
               "Available prompts")


# -- /predict in TEI's shape, and POST / -----------------------------------------------------------------


def test_tei_predict_on_a_classifier_beside_inferds_own_predict(classifier: Server) -> None:
    texts = ["a fine day", "the worst film"]
    own = _post(classifier, "/predict", {"texts": texts}).json()["results"]
    single = _post(classifier, "/predict", {"inputs": texts[0]})
    assert single.status_code == 200, single.text
    labels = single.json()
    probs = own[0]["probs"]
    assert [x["label"] for x in labels] == [["negative", "neutral", "positive"][i] for i in np.argsort(probs)[::-1]]
    np.testing.assert_allclose(sorted(x["score"] for x in labels), sorted(probs), atol=TOL)
    batch = _post(classifier, "/predict", {"inputs": [[texts[0]], [texts[1]]]}).json()
    assert len(batch) == 2 and [x["label"] for x in batch[0]] == [x["label"] for x in labels]
    np.testing.assert_allclose([x["score"] for x in batch[0]], [x["score"] for x in labels], atol=TOL)
    assert batch[1][0]["label"] == own[1]["label"]
    top = _post(classifier, "/", {"inputs": texts[1], "parameters": {"top_k": 1}}).json()  # POST /: predict
    assert len(top) == 1 and top[0]["label"] == own[1]["label"]
    assert abs(top[0]["score"] - max(own[1]["probs"])) <= TOL
    _tei_error(_post(classifier, "/predict", {"inputs": texts[0], "raw_scores": True}), 422, "validation",
               "raw_scores")
    _tei_error(_post(classifier, "/predict", {"inputs": [texts[0], texts[1]]}), 422, "validation", "pairs")
    _tei_error(_post(classifier, "/", {"inputs": "x", "parameters": {"function_to_apply": "sigmoid"}}), 422,
               "validation", "softmax")
    # "none" asks for logits, as raw_scores does: refused naming the field the client sent.
    none = _tei_error(_post(classifier, "/predict", {"inputs": "x", "parameters": {"function_to_apply": "none"}}),
                      422, "validation", "parameters.function_to_apply: ", "softmax")
    assert "raw_scores" not in none, none
    _tei_error(_post(classifier, "/embed", {"inputs": "x"}), 404, "backend", "embedding")


def test_tei_predict_and_root_on_a_reranker(reranker: Server) -> None:
    query, docs = "which river", ["the river runs past the city", "a recipe for bread"]
    scored = _post(reranker, "/rerank", {"query": query, "texts": docs, "raw_scores": False}).json()
    raw = _post(reranker, "/rerank", {"query": query, "texts": docs, "raw_scores": True}).json()
    by_index = {r["index"]: r["score"] for r in scored}
    raw_by_index = {r["index"]: r["score"] for r in raw}
    pair = _post(reranker, "/predict", {"inputs": [query, docs[0]]})
    assert pair.status_code == 200, pair.text
    assert pair.json()[0]["label"] == "LABEL_0"
    assert abs(pair.json()[0]["score"] - by_index[0]) <= TOL
    both = _post(reranker, "/predict", {"inputs": [[query, docs[0]], [query, docs[1]]], "raw_scores": True}).json()
    assert [abs(b[0]["score"] - raw_by_index[i]) <= TOL for i, b in enumerate(both)] == [True, True]
    root = _post(reranker, "/", {"query": query, "texts": docs})  # POST /: rerank, as TEI routes it
    assert root.status_code == 200 and root.json() == scored
    _tei_error(_post(reranker, "/predict", {"inputs": "one text"}), 422, "validation", "pairs")


def test_root_on_an_embedding_model_embeds_or_compares_by_the_body(mrl: Server, st_mrl: Any) -> None:
    got = _post(mrl, "/", {"inputs": ["hello world"]})
    np.testing.assert_allclose(np.array(got.json()), st_mrl.encode(["hello world"]), atol=TOL)
    sims = _post(mrl, "/", {"inputs": {"source_sentence": "hello", "sentences": ["hello world"]}, "parameters": {}})
    v = st_mrl.encode(["hello", "hello world"])
    np.testing.assert_allclose(sims.json(), [float(v[1] @ v[0])], atol=TOL)
    _tei_error(_post(mrl, "/predict", {"inputs": "x"}), 404, "backend", "embedding")
    # inferd's own /predict is untouched on the same server.
    own = _post(mrl, "/predict", {"texts": ["hello world"]}).json()
    np.testing.assert_allclose(own["results"][0], v[1], atol=TOL)


# One server per model, shared: (server, route, body) → status, TEI's error_type, words the message holds.
REFUSALS = [
    ("mrl", "/embed", b"{not json", 400, "validation", "not valid JSON"),
    ("mrl", "/embed", {"inputs": ["fine", ""]}, 422, "empty", "inputs[1]"),
    ("mrl", "/embed", {"inputs": [1, 2, 3]}, 422, "validation", "token ids"),
    ("mrl", "/embed", {"inputs": "x", "colour": "red"}, 422, "validation", "colour"),
    ("mrl", "/embed", {"inputs": ["x"] * 300}, 422, "validation", "256"),
    ("mrl", "/embed", {"inputs": "x", "truncation_direction": "up"}, 422, "validation", "truncation_direction"),
    ("mrl", "/similarity", {"inputs": {"source_sentence": "x", "sentences": []}}, 422, "empty", "sentences"),
    ("mrl", "/tokenize", {"inputs": "x", "prompt_name": "nope"}, 422, "validation", "Available prompts"),
    ("mrl", "/decode", {"ids": []}, 422, "empty", "ids"),
    ("mrl", "/", {"inputs": ""}, 422, "empty", "inputs"),
    ("mrl", "/predict", {"inputs": "x"}, 404, "backend", "embedding"),  # TEI's 424: no such model here
    ("mrl", "/rerank", {"query": "q", "texts": ["d"]}, 404, "backend", "rerank"),
    ("reranker", "/rerank", {"query": "", "texts": ["d"]}, 422, "empty", "query"),
    ("reranker", "/rerank", {"query": "q", "texts": ["d", " "]}, 422, "empty", "texts[1]"),
    ("reranker", "/rerank", {"query": "q", "texts": ["d"], "raw_scores": "yes"}, 422, "validation", "raw_scores"),
    ("reranker", "/rerank", b"[1]", 400, "validation", "object"),
    ("reranker", "/", {"query": "q", "texts": ["d"], "model": "nope"}, 404, "validation", "nope"),
    ("reranker", "/predict", {"inputs": [["q", "d"], ["x"]]}, 422, "validation", "not both"),
    ("classifier", "/predict", {"inputs": [["q", "d"]]}, 422, "validation", "pairs"),
    ("classifier", "/", {"inputs": ""}, 422, "empty", "inputs"),
]


@pytest.mark.parametrize(("server", "path", "body", "status", "error_type", "words"), REFUSALS,
                         ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(REFUSALS)])
def test_every_tei_route_refuses_in_teis_shape_with_inferds_statuses(
        request: pytest.FixtureRequest, server: str, path: str, body: Any, status: int, error_type: str,
        words: str) -> None:
    target: Server = request.getfixturevalue(server)
    if isinstance(body, bytes):
        r = httpx.post(target.url + path, content=body, timeout=30)
    else:
        r = _post(target, path, body)
    _tei_error(r, status, error_type, words)


def test_a_rerank_pair_takes_truncate_and_its_direction(reranker: Server, task_models: Path) -> None:
    from sentence_transformers import CrossEncoder

    limit = 64  # the tiny cross-encoder's max_position_embeddings
    rng = random.Random(5)
    words = [rng.choice(WORDS) for _ in range(180)]  # one token each: the pair is ~190 tokens
    query, document = "which river runs past", " ".join(words)
    # truncate: false refuses the over-long pair, naming the text at fault and the limit.
    _tei_error(_post(reranker, "/rerank", {"query": query, "texts": ["short", document], "truncate": False}), 422,
               "validation", "texts[1]", f"limit of {limit} tokens")
    _tei_error(_post(reranker, "/predict", {"inputs": [query, document], "truncate": False}), 422, "validation",
               "inputs", f"limit of {limit} tokens")
    right = _post(reranker, "/rerank", {"query": query, "texts": [document]}).json()[0]["score"]
    left = _post(reranker, "/rerank", {"query": query, "texts": [document], "truncate": True,
                                       "truncation_direction": "Left"}).json()[0]["score"]
    predicted = _post(reranker, "/predict", {"inputs": [query, document], "truncation_direction": "left"}).json()
    assert abs(predicted[0]["score"] - left) <= TOL
    # The query is kept whole; the document keeps what fits: its first words (right) or its last words (left).
    tok = Tokenizer.from_file(str(task_models / "ce" / "tokenizer.json"))
    room = limit - 3 - len(tok.encode(query, add_special_tokens=False).ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = CrossEncoder(str(task_models / "ce"), device="cpu")
    want = model.predict([(query, " ".join(words[:room])), (query, " ".join(words[-room:]))])
    np.testing.assert_allclose([right, left], want, atol=TOL)
    assert abs(left - right) > 1e-4  # the side cut changed what was scored


def test_info_carries_the_fields_tei_clients_read(mrl: Server, classifier: Server) -> None:
    info = httpx.get(mrl.url + "/info", timeout=10).json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 128 and info["max_client_batch_size"] == 256
    assert info["model_id"] == info["name"] and info["auto_truncate"] is True
    assert info["models"][0]["matryoshka_dimensions"] == [8, 16, 32]
    assert info["models"][0]["prompts"] == PROMPTS and info["dimension"] == 32  # inferd's own fields stay
    cls = httpx.get(classifier.url + "/info", timeout=10).json()
    assert cls["model_type"] == {"classifier": {"id2label": {"0": "negative", "1": "neutral", "2": "positive"},
                                                "label2id": {"negative": 0, "neutral": 1, "positive": 2}}}
