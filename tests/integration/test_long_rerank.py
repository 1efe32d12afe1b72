"""Long-document rerank (issue 41 item 3; core/long_rerank.py) through a real server, on TEI's /rerank and Cohere's
/v1/rerank and /v2/rerank.

What it proves, without a trained cross-encoder (none is available offline):

- Ranking: a late-interaction reranker (a tiny ColBERT, MaxSim) whose encoder passes each token's embedding
  through unchanged (its attention and feed-forward outputs and its position embeddings zeroed: ``controlled``)
  scores a piece by how many of the query's tokens it holds, which is token identity, not training. Three
  documents of over 2,000 tokens: the relevant one holds every query word together, but only after its first 2,000
  tokens, and opens with filler; each distractor opens with one query word. Cut to its document length (no
  chunking), the relevant document is not first (a distractor's opening matches, its does not); scored piece by
  piece it is first, and its span is the passage. The same request with chunking switched off is the control, so
  the test fails if chunking does nothing.
- Arithmetic: on a (random) cross-encoder, a split document's score is exactly the best (mode max) or the mean
  (mode mean) of its pieces' scores, each piece sent alone as an ordinary document, the pieces cut by the same
  splitter to the room the model leaves beside the query; the span is the best piece's; and a document that fits
  beside the query has the score it has unsplit and no span.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from conftest import Server
from tinymodel import write_tiny_colbert, write_tiny_cross_encoder

from inferd.core.chunking import split

ROOT = Path(__file__).resolve().parents[2]
QUERY = ["river", "mountain", "city", "house"]
MAX_BODY = 64_000  # limits.max_body_bytes here: the three documents of a request fit it, four times them do not
FILLER = "the a an is are was be to of and in on for with that this it as at by from or not but all".split()


def filler(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(words)) + "."


def documents() -> list[str]:
    rng = random.Random(4)
    passage = "a " + " ".join(QUERY) + " by the tree."
    relevant = " ".join([filler(rng, 12) for _ in range(180)] + [passage] + [filler(rng, 12) for _ in range(10)])
    distractors = [f"{QUERY[i]} " + " ".join(filler(rng, 12) for _ in range(190)) for i in range(2)]
    return [distractors[0], relevant, distractors[1]]


def controlled(folder: Path) -> Path:
    """A tiny ColBERT whose token vectors are its tokens' embeddings alone (no context, no position): a query token
    matches the same token in a document with cosine 1, and anything else at random."""
    import torch
    from transformers import BertModel

    write_tiny_colbert(folder, document_length=32)
    model = BertModel.from_pretrained(folder)
    with torch.no_grad():
        for layer in model.encoder.layer:
            for dense in (layer.attention.output.dense, layer.output.dense):
                dense.weight.zero_()
                dense.bias.zero_()
        model.embeddings.position_embeddings.weight.zero_()
        model.embeddings.token_type_embeddings.weight.zero_()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("long-rerank")
    controlled(root / "colbert")
    write_tiny_cross_encoder(root / "ce", seed=9, max_positions=64)
    return root


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    config = tmp_path_factory.mktemp("long-rerank-config")
    shutil.copy(ROOT / "configs" / "base.yaml", config / "base.yaml")
    (config / "dev.yaml").write_text(yaml.safe_dump({"models": [
        {"name": "late", "path": str(models / "colbert"), "task": "rerank"},
        {"name": "ce", "path": str(models / "ce"), "task": "rerank"}],
        "limits": {"max_body_bytes": MAX_BODY, "max_document_body_bytes": 8 * MAX_BODY}}))
    return module_serve({"INFERD_CONFIG_DIR": str(config), "INFERD__MODEL__LOAD_MODE": "eager"},
                        wait="/health/ready", timeout=180)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=120.0) as c:
        yield c


def test_chunked_rerank_finds_the_passage_truncation_never_sees(client: httpx.Client, models: Path) -> None:
    from transformers import AutoTokenizer

    docs = documents()
    query = " ".join(QUERY)
    count = AutoTokenizer.from_pretrained(models / "colbert")
    assert all(len(count(d, add_special_tokens=False)["input_ids"]) > 2000 for d in docs)
    assert len(count(docs[1][: docs[1].index(query)], add_special_tokens=False)["input_ids"]) > 2000
    cut = client.post("/v1/rerank", json={"query": query, "documents": docs, "model": "late"})
    assert cut.status_code == 200, cut.text
    assert cut.json()["results"][0]["index"] != 1  # the control: cut, the relevant document loses
    assert all("span" not in r for r in cut.json()["results"])
    for path in ("/v1/rerank", "/v2/rerank"):
        r = client.post(path, json={"query": query, "documents": docs, "model": "late", "chunking": {}})
        assert r.status_code == 200, r.text
        best = r.json()["results"][0]
        assert best["index"] == 1, r.json()
        span = best["span"]
        assert " ".join(QUERY) in docs[1][span["start"]:span["end"]] and span["pieces"] > 50
    tei = client.post("/rerank", json={"query": query, "texts": docs, "model": "late", "chunking": {"mode": "max"}})
    assert tei.status_code == 200, tei.text
    assert tei.json()[0]["index"] == 1 and "span" in tei.json()[0]


@pytest.mark.parametrize("mode", ["max", "mean"])
def test_a_split_document_scores_its_pieces_best_or_mean(client: httpx.Client, models: Path, mode: str) -> None:
    from transformers import AutoTokenizer

    rng = random.Random(8)
    long = " ".join(filler(rng, 10) for _ in range(30))
    query = "river city"
    short = "a house by the river"
    tokenizer = AutoTokenizer.from_pretrained(models / "ce")
    room = 64 - 3 - len(tokenizer(query, add_special_tokens=False)["input_ids"])
    pieces = split(long, tokenizer, max_tokens=room)
    assert len(pieces) > 3
    alone = client.post("/rerank", json={"query": query, "model": "ce", "raw_scores": True,
                                         "texts": [long[p.start:p.end] for p in pieces] + [short]})
    assert alone.status_code == 200, alone.text
    scores = {r["index"]: r["score"] for r in alone.json()}
    raw = np.asarray([scores[i] for i in range(len(pieces))])
    r = client.post("/rerank", json={"query": query, "model": "ce", "raw_scores": True, "texts": [long, short],
                                     "chunking": {"mode": mode}})
    assert r.status_code == 200, r.text
    got = {item["index"]: item for item in r.json()}
    want = raw.max() if mode == "max" else raw.mean()
    assert got[0]["score"] == pytest.approx(float(want), abs=1e-5)
    best = pieces[int(raw.argmax())]
    assert got[0]["span"] == {"start": best.start, "end": best.end, "pieces": len(pieces)}
    assert got[1]["score"] == pytest.approx(scores[len(pieces)], abs=1e-6) and "span" not in got[1]


def test_pieces_that_do_not_fit_beside_the_query_are_refused(client: httpx.Client) -> None:
    r = client.post("/v1/rerank", json={"query": "river", "documents": ["a b c"], "model": "ce",
                                        "chunking": {"max_tokens": 100}})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "chunk_too_large" and "tokens are left" in r.json()["error"]["message"]
    r = client.post("/v1/rerank", json={"query": "river", "documents": ["a b c"], "model": "ce",
                                        "chunking": {"mode": "pooled"}})
    assert r.status_code == 422


def test_predict_pairs_take_chunking_too(client: httpx.Client) -> None:
    # inferd's /predict (a reranker's [query, document] texts) and TEI's /predict ([[query, document]] inputs, on
    # the default reranker) score the same way as the rerank routes, and name the span beside each score.
    docs = documents()
    query = " ".join(QUERY)
    ranked = client.post("/v1/rerank", json={"query": query, "documents": docs[:2], "model": "late",
                                             "chunking": {}}).json()["results"]
    want = {r["index"]: r for r in ranked}
    own = client.post("/predict", json={"texts": [[query, d] for d in docs[:2]], "model": "late", "chunking": {}})
    assert own.status_code == 200, own.text
    assert own.json()["results"] == pytest.approx([want[0]["relevance_score"], want[1]["relevance_score"]], abs=1e-5)
    assert own.json()["spans"] == [want[0]["span"], want[1]["span"]]
    tei = client.post("/predict", json={"inputs": [[query, docs[1]]], "chunking": {"mode": "max"}})
    assert tei.status_code == 200, tei.text
    ((row,),) = tei.json()
    assert row["score"] == pytest.approx(want[1]["relevance_score"], abs=1e-5) and row["span"] == want[1]["span"]


def test_an_llm_reranker_s_pieces_fit_beside_its_query_and_template(tmp_path: Path) -> None:
    # The LLM reranker's room is its limit less its template, its instruction and the query: a piece of that many
    # tokens runs whole, one a little longer would be cut (what the engine's pieces are sized by).
    from decoders import write_qwen3_reranker

    from inferd.core.loading import load_handler
    from inferd.core.spec import ModelSpec

    handler = load_handler(ModelSpec(path=write_qwen3_reranker(tmp_path / "llm", max_positions=128), name="llm",
                                     version="1", device="cpu", task="rerank", warmup=False))
    try:
        query = "where is the river city"
        room = handler.document_room(query)
        assert room is not None and 0 < room < 128
        rng = random.Random(2)
        long = " ".join(filler(rng, 10) for _ in range(40))
        pieces = split(long, handler.tokenizer, max_tokens=room)
        assert len(pieces) > 3
        encoded = handler.preprocess([(query, long[p.start:p.end]) for p in pieces])
        assert not any(e.truncated for e in encoded) and max(e.tokens for e in encoded) <= 128
        over = split(long, handler.tokenizer, max_tokens=room + 12)[0]
        (cut,) = handler.preprocess([(query, long[over.start:over.end])])
        assert cut.truncated
    finally:
        handler.close()


def test_a_rerank_body_over_the_short_text_limit_is_taken_when_it_asks_for_chunking(client: httpx.Client) -> None:
    """The rerank routes take documents' bodies (limits.max_document_body_bytes) as the embedding routes do; a body
    that asks for no chunking is still held to limits.max_body_bytes, refused naming it."""
    docs = documents() * 4
    query = " ".join(QUERY)
    assert MAX_BODY < len(yaml.safe_dump(docs)) < 8 * MAX_BODY
    for path, body in (("/v1/rerank", {"query": query, "documents": docs, "model": "late"}),
                       ("/v2/rerank", {"query": query, "documents": docs, "model": "late"}),
                       ("/rerank", {"query": query, "texts": docs, "model": "late"})):
        refused = client.post(path, json=body)
        assert refused.status_code == 413, (path, refused.text)
        assert "limits.max_body_bytes" in refused.text
        taken = client.post(path, json={**body, "chunking": {}})
        assert taken.status_code == 200, (path, taken.text)
