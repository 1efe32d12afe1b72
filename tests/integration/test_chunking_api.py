"""Long documents on the wire with tiny models (issue 41 items 1 and 5), one real server: a dense BERT (window 128
tokens) and a bge-m3-shaped model (dense, sparse and token vectors from one pass).

- a document's pieces, as /v1/encode answers them, each equal to the piece sent alone as a short text: dense,
  sparse and multivector; the pooled answer merged from them (dense token-weighted and renormalised, sparse by
  max, token vectors concatenated); spans that slice the text exactly;
- a document of more pieces than the model's queue holds runs (in waves through the scheduler), and its pieces
  are answered by the result cache afterwards;
- a model's default chunking (model.chunking) for requests that ask none;
- Cohere's and TEI's answers hold the same pieces in their own shapes, and refuse in their own error shapes;
- refusals naming the limit: overlap >= piece size, a piece larger than the window leaves, a document over its
  characters or pieces, a body over limits.max_body_bytes without chunking (accepted with it).
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from conftest import ROOT, Server, metric_value
from tinymodel import CJK, WORDS, write_tiny_bert, write_tiny_colbert

from integration.test_sparse_api import write_tiny_m3

TOL = 1e-5
MAX_QUEUE = 16  # the dense model's queue: a document of more pieces runs in waves
MAX_DOC_CHARS = 60_000
MAX_PIECES = 120
MAX_BODY = 20_000
MAX_TOKEN_VECTORS = 4096


def document(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "." for _ in range(3)]
        sentences.append("".join(rng.choice(CJK) for _ in range(rng.randint(5, 25))) + "。🙂")
        out.append(" ".join(sentences))
    return "\n\n".join(out)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    tmp = tmp_path_factory.mktemp("chunking-srv")
    config = tmp / "configs"
    config.mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", config / "base.yaml")
    (config / "dev.yaml").write_text(yaml.safe_dump({
        "models": [{"name": "dense", "path": str(write_tiny_bert(tmp / "dense", seed=11)),
                    "batching": {"max_queue": MAX_QUEUE, "max_batch_size": 8}, "cache": {"max_entries": 512},
                    "chunking": {"mode": "pooled"}},
                   {"name": "m3", "path": str(write_tiny_m3(tmp / "m3"))},
                   {"name": "colbert", "path": str(write_tiny_colbert(tmp / "colbert"))}],
        "limits": {"max_document_chars": MAX_DOC_CHARS, "max_document_pieces": MAX_PIECES,
                   "max_body_bytes": MAX_BODY, "max_document_body_bytes": 200_000,
                   "max_multivector_tokens": MAX_TOKEN_VECTORS}}))
    return module_serve({"INFERD_CONFIG_DIR": str(config), "INFERD__MODEL__LOAD_MODE": "eager"},
                        wait="/health/ready", timeout=180)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _post(client: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def _pooled(vectors: list[Any], weights: list[int]) -> np.ndarray:
    mean = (np.asarray(vectors, dtype=np.float64) * np.asarray(weights, dtype=np.float64)[:, None]).sum(0)
    return mean / np.linalg.norm(mean)


def test_every_output_of_every_piece_is_the_piece_s_own(client: httpx.Client) -> None:
    text = document(1, 12)
    outputs = ["dense", "sparse", "multivector"]
    (item,) = _post(client, "/v1/encode", {"input": [text], "model": "m3", "outputs": outputs,
                                           "chunking": {"mode": "pieces", "max_tokens": 40, "overlap": 5}})["data"]
    pieces = item["pieces"]
    assert len(pieces) > 5
    texts = [text[p["start"]:p["end"]] for p in pieces]
    assert all(t and t == t.strip() for t in texts)
    alone = _post(client, "/v1/encode", {"input": texts, "model": "m3", "outputs": outputs})["data"]
    for piece, own in zip(pieces, alone, strict=True):
        assert 0 < piece["tokens"] <= 40
        np.testing.assert_allclose(piece["dense"], own["dense"], atol=TOL)
        np.testing.assert_allclose(piece["multivector"], own["multivector"], atol=TOL)
        assert piece["sparse"]["indices"] == own["sparse"]["indices"]
        np.testing.assert_allclose(piece["sparse"]["values"], own["sparse"]["values"], atol=TOL)
    np.testing.assert_allclose(item["dense"], _pooled([o["dense"] for o in alone], [p["tokens"] for p in pieces]),
                               atol=TOL)
    np.testing.assert_allclose(item["multivector"], np.concatenate([o["multivector"] for o in alone]), atol=TOL)
    best: dict[int, float] = {}
    for own in alone:
        for i, v in zip(own["sparse"]["indices"], own["sparse"]["values"], strict=True):
            best[i] = max(best.get(i, 0.0), v)
    assert item["sparse"]["indices"] == sorted(best)
    np.testing.assert_allclose(item["sparse"]["values"], [best[i] for i in sorted(best)], atol=TOL)
    # Mode pooled answers exactly the pieces' merge, in the short-text shape.
    (plain,) = _post(client, "/v1/encode", {"input": text, "model": "m3", "outputs": outputs,
                                            "chunking": {"max_tokens": 40, "overlap": 5}})["data"]
    assert "pieces" not in plain
    np.testing.assert_allclose(plain["dense"], item["dense"], atol=TOL)
    assert plain["sparse"]["indices"] == item["sparse"]["indices"]


def test_a_document_larger_than_the_queue_runs_in_waves_and_pieces_hit_the_cache(
        client: httpx.Client, server: Server) -> None:
    text = document(2, 80)
    body = {"input": [text, "a short one"], "model": "dense", "chunking": {"mode": "pieces"}}
    first = _post(client, "/v1/embeddings", body)["data"]
    pieces = first[0]["pieces"]
    assert len(pieces) > 2 * MAX_QUEUE  # more than the queue holds at once
    assert len(first[1]["pieces"]) == 1 and first[1]["pieces"][0]["start"] == 0
    # Without overlap the pieces and whitespace make up the text; each fits the window (128 less [CLS] and [SEP]).
    assert all(text[a["end"]:b["start"]].strip() == "" for a, b in zip(pieces, pieces[1:], strict=False))
    assert all(p["tokens"] <= 126 for p in pieces)
    np.testing.assert_allclose(first[0]["embedding"], _pooled([p["embedding"] for p in pieces],
                                                              [p["tokens"] for p in pieces]), atol=TOL)
    before = client.get("/metrics").text
    again = _post(client, "/v1/embeddings", body)["data"]
    after = client.get("/metrics").text
    hits = [metric_value(m, "inferd_cache_hits_total", cache="dense") for m in (before, after)]
    assert hits[1] - hits[0] == len(pieces) + 1
    np.testing.assert_allclose(again[0]["embedding"], first[0]["embedding"], atol=TOL)


def test_a_model_s_default_chunking_applies_to_requests_that_ask_none(client: httpx.Client) -> None:
    text = document(6, 8)  # over the window of 128 tokens
    (default,) = _post(client, "/v1/embeddings", {"input": text, "model": "dense"})["data"]
    asked = _post(client, "/v1/embeddings", {"input": text, "model": "dense",
                                             "chunking": {"mode": "pieces"}})["data"][0]
    assert len(asked["pieces"]) > 1
    np.testing.assert_allclose(default["embedding"], asked["embedding"], atol=TOL)
    # A model with no default cuts the text at its window, as before.
    cut = _post(client, "/v1/embeddings", {"input": text, "model": "m3"})["data"][0]["embedding"]
    pooled = _post(client, "/v1/embeddings", {"input": text, "model": "m3", "chunking": {}})["data"][0]["embedding"]
    assert np.abs(np.asarray(cut) - np.asarray(pooled)).max() > 10 * TOL


@pytest.mark.parametrize(("chunking", "field", "code"), [
    ({"max_tokens": 20, "overlap": 20}, "chunking.overlap", "overlap_too_large"),
    ({"max_tokens": 127}, "chunking.max_tokens", "chunk_too_large"),
    ({"max_tokens": 2}, "input", "too_many_pieces"),
])
def test_refusals_name_the_limit(client: httpx.Client, chunking: dict[str, Any], field: str, code: str) -> None:
    error = _post(client, "/v1/embeddings", {"input": document(3, 6), "model": "dense", "chunking": chunking},
                  422)["error"]
    assert error["code"] == code and error["param"] == field, error


def test_a_split_whose_pieces_one_count_foresees_over_the_limit_is_refused_before_it_runs(
        client: httpx.Client) -> None:
    """An overlap near the piece size makes a piece of every token or two: the splitter's work grows with its pieces
    (a probe's document took 40 s of a core to be refused after its split), so one count of the text's tokens refuses
    it first."""
    error = _post(client, "/v1/embeddings", {"input": document(3, 6), "model": "dense",
                                             "chunking": {"max_tokens": 40, "overlap": 39}}, 422)["error"]
    assert error["code"] == "too_many_pieces" and "would split into about" in error["message"], error
    assert f"the limit is {MAX_PIECES} per document" in error["message"]
    # Under the limit the guess lets the split run, and the pieces are counted as before.
    fine = _post(client, "/v1/embeddings", {"input": document(3, 1), "model": "dense",
                                            "chunking": {"mode": "pieces", "max_tokens": 40, "overlap": 10}})
    assert len(fine["data"][0]["pieces"]) > 1


def test_a_multivector_answer_over_its_limit_is_refused_before_any_piece_runs(client: httpx.Client) -> None:
    """Each wave of pieces passed the token vectors' check alone: the whole answer was refused after every piece had
    run and been charged. Mode pieces answers each piece's vectors and the document's (their join): twice as many."""
    text = document(9, 64)
    body = {"input": text, "model": "m3", "outputs": ["multivector"]}
    pooled = _post(client, "/v1/encode", {**body, "chunking": {"mode": "pooled"}})["data"][0]["multivector"]
    assert MAX_TOKEN_VECTORS / 2 < len(pooled) <= MAX_TOKEN_VECTORS, len(pooled)  # the document this test needs
    def batches() -> float:
        return metric_value(client.get("/metrics").text, "inferd_batch_size_count", model="m3")

    ran = batches()
    while time.sleep(0.3) or batches() != ran:  # the pooled answer's last batches are counted as they end
        ran = batches()
    error = _post(client, "/v1/encode", {**body, "chunking": {"mode": "pieces"}}, 422)["error"]
    assert error["code"] == "too_many_token_vectors" and str(2 * len(pooled)) in error["message"], error
    assert batches() == ran


def test_document_limits_and_the_body_limit(client: httpx.Client) -> None:
    long = document(4, 400)[:MAX_DOC_CHARS + 1]
    error = _post(client, "/v1/embeddings", {"input": [long], "model": "dense", "chunking": {}}, 422)["error"]
    assert error["code"] == "text_too_long" and str(MAX_DOC_CHARS) in error["message"]
    # A body over limits.max_body_bytes: refused without chunking, taken with it (its own, larger limit).
    texts = [document(seed, 12)[:2_000] for seed in range(12)]  # under each text's limits, over the body's
    error = _post(client, "/v1/embeddings", {"input": texts, "model": "dense"}, 413)["error"]
    assert "limits.max_body_bytes" in error["message"]
    data = _post(client, "/v1/embeddings", {"input": texts, "model": "dense", "chunking": {}})["data"]
    assert len(data) == 12


def test_cohere_and_tei_answer_pieces_and_refusals_in_their_own_shapes(client: httpx.Client) -> None:
    text = document(7, 10)
    want = _post(client, "/v1/embeddings", {"input": [text, "short"], "model": "dense",
                                            "chunking": {"mode": "pieces"}})["data"]
    tei = _post(client, "/embed", {"inputs": [text, "short"], "chunking": {"mode": "pieces"}})
    cohere = _post(client, "/v2/embed", {"texts": [text, "short"], "model": "dense", "embedding_types": ["float"],
                                         "chunking": {"mode": "pieces"}})
    for i, item in enumerate(want):
        spans = [(p["start"], p["end"], p["tokens"]) for p in item["pieces"]]
        assert [(p["start"], p["end"], p["tokens"]) for p in tei[i]] == spans
        assert [(p["start"], p["end"], p["tokens"]) for p in cohere["pieces"][i]] == spans
        vectors = [p["embedding"] for p in item["pieces"]]
        np.testing.assert_allclose([p["embedding"] for p in tei[i]], vectors, atol=TOL)
        np.testing.assert_allclose([p["embeddings"]["float"] for p in cohere["pieces"][i]], vectors, atol=TOL)
    np.testing.assert_allclose(cohere["embeddings"]["float"], [d["embedding"] for d in want], atol=TOL)
    refused = client.post("/embed", json={"inputs": text, "chunking": {"max_tokens": 8, "overlap": 8}})
    assert refused.status_code == 422 and "overlap" in refused.json()["error"], refused.text
    refused = client.post("/v2/embed", json={"texts": [text], "model": "dense", "chunking": {"max_tokens": 500}})
    body = refused.json()
    assert refused.status_code == 422 and body["error"]["param"] == "chunking.max_tokens", refused.text
    assert "window" in body["message"]


@pytest.mark.parametrize(("input_type", "length"), [("document", 24), ("query", 12)])
def test_a_colbert_document_s_pieces_fit_its_role_s_length_marker_included(client: httpx.Client, input_type: str,
                                                                           length: int) -> None:
    """Pieces were sized by the model's window (the longer role's) less [CLS] and [SEP]: the role's marker and, for a
    query, its shorter length were not counted, so each full piece lost its last tokens to the cut, embedded nowhere.
    Each piece now fits: its vectors are its text's own, alone."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(160))
    body = {"model": "colbert", "outputs": ["multivector"], "input_type": input_type}
    pieces = client.post("/v1/encode", json={**body, "input": text, "chunking": {"mode": "pieces"}})
    assert pieces.status_code == 200, pieces.text
    found = pieces.json()["data"][0]["pieces"]
    assert len(found) > 3
    for piece in found:
        assert piece["tokens"] + 3 <= length, piece  # [CLS], the marker and [SEP] beside it
        alone = client.post("/v1/encode", json={**body, "input": text[piece["start"]:piece["end"]]}).json()
        np.testing.assert_allclose(piece["multivector"], alone["data"][0]["multivector"], atol=1e-5)


def test_a_request_that_says_how_to_cut_its_texts_is_cut_as_it_says_not_chunked_by_the_model_s_default(
        client: httpx.Client) -> None:
    """The dense model splits long texts by default (model.chunking); a Cohere ``truncate`` or TEI ``truncate`` in a
    request chose cutting (or, NONE, refusing) and gets it: its vector is the text's first window's."""
    text = document(6, 8)  # over the window of 128 tokens
    chunked = _post(client, "/v1/embeddings", {"input": text, "model": "dense"})["data"][0]["embedding"]
    tokens = _post(client, "/tokenize", {"inputs": text, "add_special_tokens": True})[0]
    assert len(tokens) > 128
    # [CLS], the text's first 126 tokens and [SEP]: the window of 128 (TEI's offsets count UTF-8 bytes)
    window = text.encode()[:tokens[126]["stop"]].decode()
    want = _post(client, "/v1/embeddings", {"input": window, "model": "dense"})["data"][0]["embedding"]
    end = _post(client, "/v1/embed", {"texts": [text], "model": "dense", "truncate": "END"})["embeddings"][0]
    tei = _post(client, "/embed", {"inputs": text, "truncate": True})[0]
    np.testing.assert_allclose(end, want, atol=TOL)
    np.testing.assert_allclose(tei, want, atol=TOL)
    assert np.abs(np.asarray(end) - np.asarray(chunked)).max() > 10 * TOL
    start = _post(client, "/v1/embed", {"texts": [text], "model": "dense", "truncate": "START"})["embeddings"][0]
    assert np.abs(np.asarray(start) - np.asarray(end)).max() > 10 * TOL
    error = _post(client, "/v1/embed", {"texts": [text], "model": "dense", "truncate": "NONE"}, 422)
    assert "limit" in error["message"] or "long" in error["message"], error
