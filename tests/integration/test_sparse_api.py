"""Sparse and multi-vector outputs on the wire (issue 32), one real server of a tiny bge-m3-shaped model (XLM-RoBERTa
with ``sparse_linear`` and ``colbert_linear`` beside it) and a tiny PyLate ColBERT, each also served as a
late-interaction reranker, and a dense-only BERT.

- TEI's /embed_sparse (``[[{"index", "value"}]]``) and /embed_all (``[[[float]]]``) in the shapes of TEI's
  router/src/http/types.rs, equal to BAAI's formulas computed here on the bare model, and to inferd's /v1/encode;
- /v1/encode: any subset of dense, sparse and multivector from one pass, equal to the outputs asked alone; token
  texts on request; base64 and binary encodings; the result cache keyed by the outputs asked;
- /rerank, /v1/rerank, /v2/rerank on the late-interaction rerankers: MaxSim of the token vectors (ColBERT's query
  with its marker and expansion: /v1/encode's input_type), computed here;
- refusals: an output the model lacks, the cap on token vectors (limits.max_multivector_tokens), in each family's
  error shape;
- qdrant-client's local mode indexing the dense and sparse vectors and fusing them.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT, Server, metric_value
from tinymodel import WORDS, _tiny_encoder_config, write_tiny_bert, write_tiny_colbert

TOL = 1e-5
CAP = 48  # limits.max_multivector_tokens of the server
SPARSE_CAP = 600  # limits.max_sparse_weights of the server: two texts' SPLADE weights fit (a 291-id vocabulary)
TEXTS = ["hello world", "the cat is in the house", "a dog and a cat", "river mountain city river"]


def write_tiny_m3(folder: Path, seed: int = 5) -> Path:
    """bge-m3's layout, tiny: an XLM-RoBERTa encoder whose tokenizer names cls, eos, pad and unk, and its two heads as
    torch-saved state dicts. The sparse head's bias is positive, so every token of a text gets a weight above 0 (a
    random one would zero about half of them): the qdrant test's exact terms always carry weight."""
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

    write_tiny_bert(folder, seed=seed)
    for name in ("modules.json", "sentence_bert_config.json", "model.safetensors", "config.json"):
        (folder / name).unlink()
    for sub in ("1_Pooling", "2_Normalize"):
        shutil.rmtree(folder / sub, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"eos_token": "[SEP]", "bos_token": "[CLS]"})
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    XLMRobertaModel(XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=130,
                                     type_vocab_size=1, pad_token_id=0)).eval().save_pretrained(folder)
    sparse = torch.nn.Linear(32, 1)
    with torch.no_grad():
        sparse.weight.mul_(0.2)
        sparse.bias.fill_(1.0)
    torch.save(sparse.state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(32, 16).state_dict(), folder / "colbert_linear.pt")
    return folder


@pytest.fixture(scope="module")
def m3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_m3(tmp_path_factory.mktemp("m3") / "m3")


@pytest.fixture(scope="module")
def server(m3: Path, tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    tmp = tmp_path_factory.mktemp("sparse-srv")
    dense = write_tiny_bert(tmp / "dense", seed=6)
    from transformers import BertForMaskedLM

    BertForMaskedLM(_tiny_encoder_config(tmp / "mlm", 8, 32, 2, 64)).eval().save_pretrained(tmp / "mlm")
    config = tmp / "configs"
    config.mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", config / "base.yaml")
    (config / "dev.yaml").write_text(yaml.safe_dump({
        "models": [{"name": "m3", "path": str(m3), "cache": {"max_entries": 256}},
                   {"name": "m3-rerank", "path": str(m3), "task": "rerank"},
                   {"name": "colbert-rerank", "path": str(write_tiny_colbert(tmp / "colbert")), "task": "rerank"},
                   {"name": "colbert", "path": str(tmp / "colbert")},
                   {"name": "dense", "path": str(dense)},
                   {"name": "splade", "path": str(tmp / "mlm"), "pooling": "splade"}],
        "limits": {"max_multivector_tokens": CAP, "max_sparse_weights": SPARSE_CAP}}))
    # Three loads (the bge-m3 folder twice) on a busy CI machine: more than the one-model default of 60 s.
    return module_serve({"INFERD_CONFIG_DIR": str(config), "INFERD__MODEL__LOAD_MODE": "eager"},
                        wait="/health/ready", timeout=180)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def reference(folder: Path, text: str) -> dict[str, Any]:
    """BAAI's formulas on the bare model: the first token normalised; relu(sparse_linear) per token, the largest per
    id, cls/eos/pad/unk left out; colbert_linear of every token after the first, normalised."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    sparse, colbert = torch.nn.Linear(32, 1), torch.nn.Linear(32, 16)
    sparse.load_state_dict(torch.load(folder / "sparse_linear.pt", weights_only=True))
    colbert.load_state_dict(torch.load(folder / "colbert_linear.pt", weights_only=True))
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        weights = torch.relu(sparse(hidden))[:, 0].tolist()
        tokens = torch.nn.functional.normalize(colbert(hidden[1:]), dim=-1).numpy()
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    lexical: dict[int, float] = {}
    for i, w in zip(ids[0].tolist(), weights, strict=True):
        if i not in unused and w > 0:
            lexical[i] = max(lexical.get(i, 0.0), w)
    return {"dense": torch.nn.functional.normalize(hidden[0], dim=-1).numpy(), "sparse": dict(sorted(lexical.items())),
            "multivector": tokens, "tokens": {i: tokenizer.convert_ids_to_tokens(i) for i in lexical},
            "hidden": hidden.numpy()}


def _encode(client: httpx.Client, texts: Any, outputs: list[str], **extra: Any) -> list[dict[str, Any]]:
    r = client.post("/v1/encode", json={"input": texts, "outputs": outputs, **extra})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_tei_routes_answer_tei_s_shapes_with_baai_s_outputs(client: httpx.Client, m3: Path) -> None:
    refs = [reference(m3, t) for t in TEXTS]
    sparse = client.post("/embed_sparse", json={"inputs": TEXTS})
    assert sparse.status_code == 200, sparse.text
    for got, ref in zip(sparse.json(), refs, strict=True):
        assert [p["index"] for p in got] == list(ref["sparse"])
        assert all(set(p) == {"index", "value"} for p in got)
        np.testing.assert_allclose([p["value"] for p in got], list(ref["sparse"].values()), atol=TOL)
    every = client.post("/embed_all", json={"inputs": TEXTS[1], "truncation_direction": "Right"})
    assert every.status_code == 200, every.text
    (tokens,) = every.json()  # one text: still a list of inputs, as TEI answers: its last hidden states
    np.testing.assert_allclose(np.asarray(tokens), refs[1]["hidden"], atol=TOL)
    # One pass, three outputs, each equal to what it is alone and to the formulas.
    both = _encode(client, TEXTS, ["multivector", "dense", "sparse"], return_tokens=True)
    for item, ref, alone in zip(both, refs, _encode(client, TEXTS, ["sparse"]), strict=True):
        np.testing.assert_allclose(item["dense"], ref["dense"], atol=TOL)
        np.testing.assert_allclose(item["multivector"], ref["multivector"], atol=TOL)
        assert item["sparse"]["indices"] == list(ref["sparse"]) == alone["sparse"]["indices"]
        assert item["sparse"]["tokens"] == [ref["tokens"][i] for i in ref["sparse"]] and "tokens" not in alone["sparse"]
        np.testing.assert_allclose(item["sparse"]["values"], alone["sparse"]["values"], atol=TOL)
        assert "dense" not in alone and "multivector" not in alone
    dense = client.post("/v1/embeddings", json={"input": TEXTS, "model": "m3"}).json()["data"]
    np.testing.assert_allclose([d["embedding"] for d in dense], [i["dense"] for i in both], atol=TOL)


def test_a_splade_model_s_weights_on_tei_s_route(client: httpx.Client, server: Server) -> None:
    """model.pooling: splade on a masked LM: log(1 + relu(logits)), the largest over the text's tokens."""
    from transformers import AutoTokenizer, BertForMaskedLM

    folder = Path(server.env["INFERD_CONFIG_DIR"]).parent / "mlm"
    tokenizer, model = AutoTokenizer.from_pretrained(folder), BertForMaskedLM.from_pretrained(folder).eval()
    r = client.post("/embed_sparse", json={"inputs": TEXTS[:2], "model": "splade"})
    assert r.status_code == 200, r.text
    for text, got in zip(TEXTS[:2], r.json(), strict=True):
        with torch.no_grad():
            weights = torch.log1p(torch.relu(model(**tokenizer(text, return_tensors="pt")).logits[0])).max(dim=0).values
        want = torch.nonzero(weights).flatten().tolist()
        assert [p["index"] for p in got] == want
        np.testing.assert_allclose([p["value"] for p in got], weights[want].numpy(), atol=TOL)
    r = client.post("/v1/encode", json={"input": "hello", "model": "splade"})  # dense: the default output
    assert r.status_code == 422 and r.json()["error"]["code"] == "unsupported_output"


def test_encodings_and_the_cache_keyed_by_the_outputs_asked(client: httpx.Client) -> None:
    floats = _encode(client, ["cat dog"], ["dense", "multivector"])[0]
    packed = _encode(client, ["cat dog"], ["dense", "multivector"], encoding_format="base64")[0]
    assert np.frombuffer(base64.b64decode(packed["dense"]), "<f4").tolist() == pytest.approx(floats["dense"], abs=TOL)
    np.testing.assert_allclose([np.frombuffer(base64.b64decode(v), "<f4") for v in packed["multivector"]],
                               floats["multivector"], atol=TOL)
    bits = _encode(client, ["cat dog"], ["multivector"], encoding_format="ubinary")[0]["multivector"]
    assert bits == np.packbits(np.asarray(floats["multivector"]) > 0, axis=-1).tolist()
    # The model's cache is on: the same text asked for other outputs is another entry, never the first answer.
    text = "a text asked twice"
    before = client.get("/metrics").text
    first = _encode(client, [text], ["dense"])[0]
    second = _encode(client, [text], ["sparse"])[0]
    assert set(first) == {"object", "index", "dense"} and set(second) == {"object", "index", "sparse"}
    after = client.get("/metrics").text
    for output in ("dense", "sparse"):  # one text asked for each
        counted = [metric_value(m, "inferd_output_items_total", model="m3", output=output) for m in (before, after)]
        assert counted[1] - counted[0] == 1


@pytest.mark.parametrize(("encoder", "reranker"), [("m3", "m3-rerank"), ("colbert", "colbert-rerank")])
def test_a_late_interaction_model_reranks_by_maxsim(client: httpx.Client, encoder: str, reranker: str) -> None:
    """bge-m3's token vectors, and ColBERT's, whose query is encoded with its marker and expansion (input_type)."""
    query, docs = "cat in the house", ["the dog runs", "a cat is in the house", "river and mountain"]
    q = np.asarray(_encode(client, [query], ["multivector"], model=encoder, input_type="query")[0]["multivector"])
    want = [float((q @ np.asarray(d["multivector"]).T).max(axis=1).sum())
            for d in _encode(client, docs, ["multivector"], model=encoder)]
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    tei = client.post("/rerank", json={"query": query, "texts": docs, "model": reranker})
    assert tei.status_code == 200, tei.text
    assert [r["index"] for r in tei.json()] == order
    np.testing.assert_allclose([r["score"] for r in tei.json()], [want[i] for i in order], atol=1e-4)
    for path in ("/v1/rerank", "/v2/rerank"):
        r = client.post(path, json={"query": query, "documents": docs, "model": reranker})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        np.testing.assert_allclose([x["relevance_score"] for x in results], [want[i] for i in order], atol=1e-4)


def test_what_a_model_cannot_give_and_the_token_vector_cap_are_refused_by_name(client: httpx.Client) -> None:
    gives = {m["name"]: m["outputs"] for m in client.get("/info").json()["models"]}
    assert (gives["m3"], gives["splade"], gives["colbert"], gives["dense"], gives["m3-rerank"]) == (
        ["dense", "sparse", "multivector", "token_states"], ["sparse"], ["multivector"], ["dense", "token_states"],
        None)
    r = client.post("/v1/encode", json={"input": "hello", "outputs": ["sparse"], "model": "dense"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "outputs"
    assert r.json()["error"]["message"] == ("outputs: sparse is not an output of model 'dense', which gives dense, "
                                            "token_states")
    assert r.json()["error"]["code"] == "unsupported_output"
    r = client.post("/embed_sparse", json={"inputs": "hello", "model": "dense"})
    assert r.status_code == 422 and r.json() == {
        "error": "model: sparse is not an output of model 'dense', which gives dense, token_states",
        "error_type": "validation"}
    long = [" ".join(WORDS[:20])] * 3  # 3 x 21 token vectors > CAP
    r = client.post("/embed_all", json={"inputs": long})
    assert r.status_code == 422 and "limits.max_multivector_tokens" in r.json()["error"], r.text
    r = client.post("/v1/encode", json={"input": long, "outputs": ["multivector"]})
    assert r.status_code == 422 and "limits.max_multivector_tokens" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "too_many_token_vectors"
    assert client.post("/v1/encode", json={"input": long[:2], "outputs": ["multivector"]}).status_code == 200
    r = client.post("/v1/encode", json={"input": "hello", "outputs": ["colbert"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "outputs.0"


def test_the_token_vector_cap_is_decided_before_the_pass(client: httpx.Client) -> None:
    # Counted once tokenised, before the request queues: no batch runs and no tokens are used (issue 39: the pass
    # ran, its tokens were charged, and then the answer was refused). A late-interaction reranker's pairs are
    # scores, not token vectors: the cap is not theirs.
    long = [" ".join(WORDS[:20]) + f" {i}" for i in range(3)]  # uncached: 3 x 22 token vectors > CAP

    def batches() -> float:
        text = client.get("/metrics").text
        return sum(metric_value(text, "inferd_batch_size_count", model=m) for m in ("m3", "colbert"))

    before = batches()
    for model in ("m3", "colbert"):
        r = client.post("/v1/encode", json={"input": long, "outputs": ["multivector"], "model": model})
        assert r.status_code == 422 and r.json()["error"]["code"] == "too_many_token_vectors", r.text
        assert r.json()["error"]["param"] == "input" and "limits.max_multivector_tokens" in r.json()["error"]["message"]
    r = client.post("/embed_all", json={"inputs": long, "model": "m3"})  # its token states, as many
    assert r.status_code == 422 and "limits.max_multivector_tokens" in r.json()["error"], r.text
    # A ColBERT graph keeps only its projection: TEI's hidden states are not its to give.
    r = client.post("/embed_all", json={"inputs": long, "model": "colbert"})
    assert r.status_code == 422 and r.json()["error"] == (
        "model: token_states is not an output of model 'colbert', which gives multivector"), r.text
    assert batches() == before
    for model in ("m3-rerank", "colbert-rerank"):
        r = client.post("/v1/rerank", json={"query": "q", "documents": long * 3, "model": model})
        assert r.status_code == 200, r.text


def test_a_sparse_answer_over_its_cap_is_refused_before_it_is_built(client: httpx.Client) -> None:
    # Each text alone fits; together they hold more weights than limits.max_sparse_weights (issue 39: 256 short
    # texts to a SPLADE model answered 268 MB).
    texts = [f"{w} {v}" for w, v in zip(WORDS[:10], WORDS[10:20], strict=True)]
    alone = [client.post("/embed_sparse", json={"inputs": t, "model": "splade"}) for t in texts]
    assert all(r.status_code == 200 for r in alone)
    assert sum(len(r.json()[0]) for r in alone) > SPARSE_CAP
    r = client.post("/embed_sparse", json={"inputs": texts, "model": "splade"})
    assert r.status_code == 422 and "limits.max_sparse_weights" in r.json()["error"], r.text
    r = client.post("/v1/encode", json={"input": texts, "outputs": ["sparse"], "model": "splade",
                                        "return_tokens": True})
    assert r.status_code == 422 and r.json()["error"]["code"] == "too_many_sparse_weights", r.text
    assert r.json()["error"]["param"] == "input" and "model.sparse_top_k" in r.json()["error"]["message"]


def test_qdrant_hybrid_query_ranks_the_exact_term_first(client: httpx.Client) -> None:
    """Each document holds one word no other text holds, among words every document shares; a query holds that word
    among words no document holds. The sparse side then matches that document alone, so reciprocal rank fusion ranks
    it first whatever the dense side's order (random here); dense search alone does not for every query."""
    from qdrant_client import QdrantClient, models

    shared = "the cat and the dog in the house"
    rare = ["river", "mountain", "city", "car", "tree", "memory", "network", "server"]
    corpus = [f"{shared} {w}" for w in rare]
    fillers = "yes no one two"  # in no document
    queries = [(f"{fillers} {w}", i) for i, w in enumerate(rare)]
    docs = _encode(client, corpus, ["dense", "sparse"])
    db = QdrantClient(":memory:")
    db.create_collection("docs", vectors_config={"dense": models.VectorParams(size=len(docs[0]["dense"]),
                                                                              distance=models.Distance.COSINE)},
                         sparse_vectors_config={"sparse": models.SparseVectorParams()})
    db.upsert("docs", points=[models.PointStruct(id=i, vector={"dense": d["dense"],
                                                               "sparse": models.SparseVector(**d["sparse"])})
                              for i, d in enumerate(docs)])
    dense_firsts = 0
    for (text, want), q in zip(queries, _encode(client, [t for t, _ in queries], ["dense", "sparse"]), strict=True):
        hits = db.query_points("docs", prefetch=[
            models.Prefetch(query=q["dense"], using="dense", limit=len(corpus)),
            models.Prefetch(query=models.SparseVector(**q["sparse"]), using="sparse", limit=len(corpus))],
            query=models.FusionQuery(fusion=models.Fusion.RRF), limit=3).points
        assert hits[0].id == want, (text, [h.id for h in hits])
        dense_firsts += db.query_points("docs", query=q["dense"], using="dense", limit=1).points[0].id == want
    assert dense_firsts < len(queries)  # the sparse side decided
