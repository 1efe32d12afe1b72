"""Long documents with the real all-MiniLM-L6-v2 on every embedding API (issue 41's "what it must show"): one
document of more than 20,000 tokens (English paragraphs, Chinese, emoji) embedded per piece and pooled through
OpenAI's /v1/embeddings (the ``openai`` client), Cohere's /v2/embed (``cohere.ClientV2``), TEI's /embed and
inferd's /v1/encode.

Each piece's span slices the document to a text whose sentence-transformers ``encode`` is the piece's vector
(cosine >= 0.9999), and whose token count is the piece's; the pieces cover the document (whitespace between
them); the pooled vector is the token-weighted mean of the pieces' sentence-transformers vectors, renormalised.
The server's cache is on, so the four APIs compute the pieces once (each API's shaping is what differs).
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import openai
import pytest
from conftest import Server
from sentence_transformers import SentenceTransformer

from inferd.settings import ModelSettings, resolve_model_path

pytestmark = pytest.mark.model

COS = 0.9999
WORDS = ("river city bridge morning traffic market harbour ship cargo train station museum garden library school "
         "teacher student lesson history science music painting theatre festival winter summer rain snow wind "
         "mountain valley forest field farmer bread cheese coffee").split()
CHINESE = ("机器学习是人工智能的一个分支。", "深度学习模型需要大量的数据。", "这座城市的河流穿过古老的桥梁。")
EMOJI = ("🙂", "🚀", "👩‍👩‍👧", "🇫🇷", "☕")


def document() -> str:
    rng = random.Random(41)
    paragraphs = []
    while True:
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize() + "."
                     for _ in range(rng.randint(2, 6))]
        sentences.insert(rng.randint(0, len(sentences)), rng.choice(CHINESE) + rng.choice(EMOJI))
        paragraphs.append(" ".join(sentences))
        if len(paragraphs) % 50 == 0 and sum(map(len, paragraphs)) > 110_000:
            return "\n\n".join(paragraphs)


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model_path(ModelSettings())


@pytest.fixture(scope="module")
def text(folder: Path) -> str:
    return document()


@pytest.fixture(scope="module")
def st(folder: Path) -> SentenceTransformer:
    return SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def server(folder: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(folder), "INFERD__MODEL__NAME": "minilm", "INFERD__MODEL__LOAD_MODE": "eager",
        "INFERD__RUNTIME__TORCH_THREADS": "2", "INFERD__CACHE__MAX_ENTRIES": "1024",
        # A hundred pieces on a busy two-core CI machine: more than the default deadline of a request.
        "INFERD__BATCHING__DEFAULT_TIMEOUT_MS": "600000"},
        wait="/health/ready", timeout=180)


# Each API's call in mode "pieces" -> (pooled vector, [(start, end, tokens, vector)]), and in mode "pooled" ->
# the pooled vector, through the API's own client where it has one that can send the field.

def _openai(server: Server, text: str, mode: str) -> Any:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)
    got = client.embeddings.create(model="minilm", input=[text], extra_body={"chunking": {"mode": mode}})
    (item,) = got.data
    if mode == "pooled":
        return item.embedding
    # The client asks for base64 and decodes ``embedding`` itself; the pieces' vectors come in the same encoding.
    return item.embedding, [(p["start"], p["end"], p["tokens"], np.frombuffer(base64.b64decode(p["embedding"]), "<f4"))
                            for p in item.model_extra["pieces"]]


def _cohere(server: Server, text: str, mode: str) -> Any:
    client = cohere.ClientV2(api_key="none", base_url=server.url, timeout=300)
    got = client.embed(model="minilm", texts=[text], input_type="search_document", embedding_types=["float"],
                       request_options={"additional_body_parameters": {"chunking": {"mode": mode}}})
    if mode == "pooled":
        return got.embeddings.float_[0]
    (pieces,) = got.model_extra["pieces"] if got.model_extra else got.pieces  # type: ignore[attr-defined]
    return got.embeddings.float_[0], [(p["start"], p["end"], p["tokens"], p["embeddings"]["float"]) for p in pieces]


def _tei(server: Server, text: str, mode: str) -> Any:
    r = httpx.post(server.url + "/embed", json={"inputs": text, "chunking": {"mode": mode}}, timeout=300)
    assert r.status_code == 200, r.text
    if mode == "pooled":
        return r.json()[0]
    (pieces,) = r.json()
    vectors = np.asarray([p["embedding"] for p in pieces])
    weights = np.asarray([p["tokens"] for p in pieces], dtype=np.float64)
    mean = (vectors * weights[:, None]).sum(0)  # TEI's pieces answer has no pooled vector: the test's own
    return mean / np.linalg.norm(mean), [(p["start"], p["end"], p["tokens"], p["embedding"]) for p in pieces]


def _encode(server: Server, text: str, mode: str) -> Any:
    r = httpx.post(server.url + "/v1/encode", json={"input": [text], "chunking": {"mode": mode}}, timeout=300)
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    if mode == "pooled":
        return item["dense"]
    return item["dense"], [(p["start"], p["end"], p["tokens"], p["dense"]) for p in item["pieces"]]


APIS = {"openai": _openai, "cohere": _cohere, "tei": _tei, "encode": _encode}


@pytest.fixture(scope="module")
def reference(server: Server, text: str, st: SentenceTransformer) -> dict[str, Any]:
    """The pieces as inferd splits them (OpenAI's answer), and sentence-transformers' vectors of their texts."""
    _, pieces = _openai(server, text, "pieces")
    texts = [text[s:e] for s, e, _, _ in pieces]
    return {"spans": [(s, e, n) for s, e, n, _ in pieces], "vectors": st.encode(texts, batch_size=32)}


def _cos(a: Any, b: Any) -> np.ndarray:
    a, b = np.atleast_2d(np.asarray(a, dtype=np.float64)), np.atleast_2d(np.asarray(b, dtype=np.float64))
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_the_document_is_long_and_mixed(text: str, st: SentenceTransformer, reference: dict[str, Any]) -> None:
    tokens = len(st.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert tokens >= 20_000
    spans = reference["spans"]
    pieces = [text[s:e] for s, e, _ in spans]
    assert any(c in p for p in pieces for c in CHINESE[0]) and any(e in p for p in pieces for e in EMOJI)
    # The pieces cover the document: only whitespace between and around them, never a cut word.
    assert text[:spans[0][0]].strip() == "" and text[spans[-1][1]:].strip() == ""
    assert all(text[a[1]:b[0]].isspace() for a, b in zip(spans, spans[1:], strict=False))
    for piece, (_, _, n) in zip(pieces, spans, strict=True):
        assert n == len(st.tokenizer(piece, add_special_tokens=False)["input_ids"]) <= st.max_seq_length - 2


@pytest.mark.parametrize("api", list(APIS))
def test_pieces_and_pooled_equal_sentence_transformers(api: str, server: Server, text: str,
                                                       reference: dict[str, Any]) -> None:
    pooled, pieces = APIS[api](server, text, "pieces")
    assert [(s, e, n) for s, e, n, _ in pieces] == reference["spans"]
    assert _cos([v for *_, v in pieces], reference["vectors"]).min() >= COS
    weights = np.asarray([n for _, _, n in reference["spans"]], dtype=np.float64)
    want = (reference["vectors"].astype(np.float64) * weights[:, None]).sum(0)
    want /= np.linalg.norm(want)
    assert _cos(pooled, want)[0] >= COS
    assert abs(np.linalg.norm(pooled) - 1) < 1e-4  # renormalised: MiniLM's vectors are unit length
    assert _cos(APIS[api](server, text, "pooled"), want)[0] >= COS
