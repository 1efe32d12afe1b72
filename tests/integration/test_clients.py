"""The clients users already have, unchanged, against real servers (tiny random models, an API key set):
huggingface_hub's InferenceClient, llama-index's and LangChain's text-embeddings-inference embeddings,
tei-client, the cohere SDK's embed (v1 and v2, every embedding type) and the openai SDK with ``dimensions`` on
a Matryoshka-declared model. Vectors equal sentence-transformers' (prompts, truncate_dim), binary and int8
outputs equal ``quantize_embeddings`` given the calibration texts' ranges. The README's first requests (each
``curl`` and each client snippet) run as written on the embedding server.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import openai
import pytest
from conftest import Server
from huggingface_hub import InferenceClient
from prompted import PROMPTS, add_matryoshka_card, add_prompts, sentence_transformer
from sentence_transformers.quantization import quantize_embeddings
from tei_client import HttpClient
from tinymodel import write_tiny_bert, write_tiny_classifier, write_tiny_cross_encoder

from inferd.core import quantize

KEY = "key-1"
TOL = 1e-5
TEXTS = ["the river runs past the old city", "a recipe for bread", "你好世界", "the cat is in the house"]


pytestmark = pytest.mark.usefixtures("hub_client_online")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("client-models")
    add_matryoshka_card(add_prompts(write_tiny_bert(root / "emb", seed=31)))
    write_tiny_classifier(root / "cls", seed=32)
    write_tiny_cross_encoder(root / "ce", seed=33)
    return root


def _serve(module_serve: Callable[..., Server], path: Path, name: str) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(path), "INFERD__MODEL__NAME": name, "INFERD__MODEL__LOAD_MODE": "eager",
        "INFERD__SERVER__API_KEYS": KEY}, wait="/health/ready")


@pytest.fixture(scope="module")
def embedder(root: Path, module_serve: Callable[..., Server]) -> Server:
    return _serve(module_serve, root / "emb", "tiny-mrl")


@pytest.fixture(scope="module")
def classifier(root: Path, module_serve: Callable[..., Server]) -> Server:
    return _serve(module_serve, root / "cls", "tiny-cls")


@pytest.fixture(scope="module")
def reranker(root: Path, module_serve: Callable[..., Server]) -> Server:
    return _serve(module_serve, root / "ce", "tiny-ce")


@pytest.fixture(scope="module")
def st(root: Path) -> Any:
    return sentence_transformer(root / "emb")


def _probs(server: Server, texts: list[str]) -> list[np.ndarray]:
    r = httpx.post(server.url + "/predict", json={"texts": texts}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return [np.array(x["probs"]) for x in r.json()["results"]]


# -- huggingface_hub, LangChain, llama-index --------------------------------------------------------------


def test_huggingface_hub_feature_extraction_and_sentence_similarity(embedder: Server, st: Any) -> None:
    client = InferenceClient(base_url=embedder.url, token=KEY, timeout=30)
    got = client.feature_extraction(TEXTS[0])
    assert got.shape == (1, 32)
    np.testing.assert_allclose(got[0], st.encode(TEXTS[0]), atol=TOL)
    prompted = client.feature_extraction(TEXTS[0], prompt_name="query", dimensions=16)
    want = st.encode([TEXTS[0]], prompt_name="query", truncate_dim=16, normalize_embeddings=True)
    np.testing.assert_allclose(prompted, want, atol=TOL)
    sims = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    v = st.encode(TEXTS)
    np.testing.assert_allclose(sims, v[1:] @ v[0], atol=TOL)


def test_huggingface_hub_text_classification(classifier: Server) -> None:
    client = InferenceClient(base_url=classifier.url, token=KEY, timeout=30)
    got = client.text_classification("a fine day")
    # TEI answers one text with its labels best first; the client keeps the first: the best label.
    probs = _probs(classifier, ["a fine day"])[0]
    best = ["negative", "neutral", "positive"][int(probs.argmax())]
    assert got.label == best and abs(got.score - probs.max()) <= TOL


def test_huggingface_hub_errors_reach_the_client(embedder: Server) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as caught:
        InferenceClient(base_url=embedder.url, token=KEY, timeout=30).feature_extraction("x", prompt_name="nope")
    assert caught.value.response.status_code == 422 and "Available prompts" in caught.value.response.text
    with pytest.raises(HfHubHTTPError) as caught:
        InferenceClient(base_url=embedder.url, token="wrong", timeout=30).feature_extraction("x")
    assert caught.value.response.status_code == 401


def test_langchain_huggingface_endpoint_embeddings(embedder: Server, st: Any) -> None:
    from langchain_huggingface import HuggingFaceEndpointEmbeddings

    emb = HuggingFaceEndpointEmbeddings(model=embedder.url, huggingfacehub_api_token=KEY)
    np.testing.assert_allclose(emb.embed_documents(TEXTS), st.encode(TEXTS), atol=TOL)
    np.testing.assert_allclose(emb.embed_query(TEXTS[1]), st.encode(TEXTS[1]), atol=TOL)


def test_llama_index_text_embeddings_inference(embedder: Server, st: Any) -> None:
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    emb = TextEmbeddingsInference(model_name="tiny-mrl", base_url=embedder.url, auth_token=KEY, timeout=30)
    np.testing.assert_allclose(emb.get_text_embedding_batch(TEXTS), st.encode(TEXTS), atol=TOL)
    np.testing.assert_allclose(emb.get_query_embedding(TEXTS[2]), st.encode(TEXTS[2]), atol=TOL)
    # Its instructions are prepended by the client itself: the server embeds what it is sent.
    instructed = TextEmbeddingsInference(model_name="tiny-mrl", base_url=embedder.url, auth_token=KEY,
                                         query_instruction="query:")
    np.testing.assert_allclose(instructed.get_query_embedding("a cat"), st.encode("query: a cat"), atol=TOL)


# -- tei-client ---------------------------------------------------------------------------------------------


def test_tei_client_on_an_embedding_model(embedder: Server, st: Any, root: Path) -> None:
    client = HttpClient(embedder.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    info = client.info()
    assert info.server_model_type.value == "embedding" and info.server_model_metadata.pooling == "mean"
    assert info.max_input_length == 128
    np.testing.assert_allclose(client.embed(TEXTS), st.encode(TEXTS), atol=TOL)
    np.testing.assert_allclose(client.embed(TEXTS, prompt_name="document"), st.encode(TEXTS, prompt_name="document"),
                               atol=TOL)
    assert sorted(client.prompt_names()) == sorted(PROMPTS)
    (tokens,) = client.tokenize("hello world")
    assert client.decode(tokens.get_ids()) == ["hello world"]


def test_tei_client_classify_and_rerank(classifier: Server, reranker: Server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    cls = HttpClient(classifier.url, headers=headers, timeout=30)
    results = cls.classify(["a fine day", "the worst film"])
    for result, probs in zip(results, _probs(classifier, ["a fine day", "the worst film"]), strict=True):
        assert [s.label for s in result.scores][0] == ["negative", "neutral", "positive"][int(probs.argmax())]
        np.testing.assert_allclose(sorted(s.score for s in result.scores), sorted(probs), atol=TOL)
    ce = HttpClient(reranker.url, headers=headers, timeout=30)
    ranks = ce.rerank("which river", ["the river runs past the city", "a recipe for bread"], return_text=True)
    assert sorted(r.index for r in ranks.ranks) == [0, 1] and ranks.ranks[0].score >= ranks.ranks[1].score
    assert ranks.ranks[0].text in ("the river runs past the city", "a recipe for bread")


# -- cohere ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def calibrated(st: Any) -> np.ndarray:
    """The calibration texts embedded by sentence-transformers: the ranges int8/uint8 must be measured on."""
    return st.encode(quantize.calibration_texts(None), prompt="")  # as they are: no prompt


def _close_buckets(got: Any, want: np.ndarray) -> None:
    # Equal to quantize_embeddings, up to a bucket where float noise (1e-7) sits on a bucket's edge.
    diff = np.abs(np.asarray(got, dtype=np.int64) - want.astype(np.int64))
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.98, diff


def test_cohere_v2_embed_every_type(embedder: Server, st: Any, calibrated: np.ndarray) -> None:
    client = cohere.ClientV2(api_key=KEY, base_url=embedder.url, timeout=30)
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    got = client.embed(model="tiny-mrl", texts=TEXTS, input_type="search_query", embedding_types=types)
    want = st.encode(TEXTS, prompt_name="query")
    e = got.embeddings
    np.testing.assert_allclose(e.float_, want, atol=TOL)
    for kind in ("binary", "ubinary"):
        np.testing.assert_array_equal(getattr(e, kind), quantize_embeddings(want, kind))
    for kind in ("int8", "uint8"):
        _close_buckets(getattr(e, kind), quantize_embeddings(want, kind, calibration_embeddings=calibrated))
    decoded = np.array([np.frombuffer(base64.b64decode(b), dtype="<f4") for b in e.base64])
    np.testing.assert_allclose(decoded, want, atol=TOL)
    assert got.texts == TEXTS and got.meta.billed_units.input_tokens > 0
    # Documents get the model's document prompt; output_dimension cuts and renormalises.
    docs = client.embed(model="tiny-mrl", texts=TEXTS, input_type="search_document", embedding_types=["float"],
                        output_dimension=16)
    np.testing.assert_allclose(docs.embeddings.float_, st.encode(TEXTS, prompt_name="document", truncate_dim=16,
                                                                 normalize_embeddings=True), atol=TOL)
    small = client.embed(model="tiny-mrl", texts=TEXTS, input_type="search_document", embedding_types=["int8"],
                         output_dimension=8)
    cut = st.encode(TEXTS, prompt_name="document", truncate_dim=8, normalize_embeddings=True)
    cal = quantize.unit(calibrated[:, :8])
    _close_buckets(small.embeddings.int8, quantize_embeddings(cut, "int8", calibration_embeddings=cal))


def test_cohere_v1_embed_floats_and_by_type(embedder: Server, st: Any) -> None:
    client = cohere.Client(api_key=KEY, base_url=embedder.url, timeout=30)
    plain = client.embed(texts=TEXTS, model="tiny-mrl")
    assert plain.response_type == "embeddings_floats"
    np.testing.assert_allclose(plain.embeddings, st.encode(TEXTS), atol=TOL)
    typed = client.embed(texts=TEXTS, model="tiny-mrl", input_type="classification", embedding_types=["ubinary"])
    assert typed.response_type == "embeddings_by_type"
    np.testing.assert_array_equal(typed.embeddings.ubinary,
                                  quantize_embeddings(st.encode(TEXTS, prompt_name="classification"), "ubinary"))
    # clustering: the model has no such prompt, so the text is embedded alone.
    clustered = client.embed(texts=TEXTS[:1], model="tiny-mrl", input_type="clustering")
    np.testing.assert_allclose(clustered.embeddings, st.encode(TEXTS[:1]), atol=TOL)


def test_cohere_refusals_reach_the_sdk(embedder: Server) -> None:
    client = cohere.ClientV2(api_key=KEY, base_url=embedder.url, timeout=30)
    with pytest.raises(cohere.errors.UnprocessableEntityError) as caught:
        client.embed(model="tiny-mrl", texts=["fine", ""], input_type="search_query", embedding_types=["float"])
    assert "texts[1]" in str(caught.value.body)
    with pytest.raises(cohere.errors.UnprocessableEntityError) as caught:
        client.embed(model="tiny-mrl", texts=["fine"], input_type="search_query", embedding_types=["float"],
                     output_dimension=12)
    assert "output_dimension" in str(caught.value.body)
    with pytest.raises(cohere.errors.UnprocessableEntityError):
        client.embed(model="tiny-mrl", texts=["word " * 400], input_type="search_query", embedding_types=["float"],
                     truncate="NONE")
    with pytest.raises(cohere.errors.NotFoundError):
        client.embed(model="embed-english-v3.0", texts=["fine"], input_type="search_query", embedding_types=["float"])


# -- openai ---------------------------------------------------------------------------------------------------


def test_openai_dimensions_on_a_matryoshka_model(embedder: Server, st: Any) -> None:
    client = openai.OpenAI(base_url=embedder.url + "/v1", api_key=KEY, timeout=30)
    got = client.embeddings.create(model="tiny-mrl", input=TEXTS, dimensions=16)
    vectors = np.array([d.embedding for d in got.data])
    np.testing.assert_allclose(vectors, st.encode(TEXTS, truncate_dim=16, normalize_embeddings=True), atol=TOL)
    b64 = client.embeddings.create(model="tiny-mrl", input=TEXTS[:1], dimensions=8, encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(decoded, st.encode(TEXTS[0], truncate_dim=8, normalize_embeddings=True), atol=TOL)
    with pytest.raises(openai.UnprocessableEntityError):
        client.embeddings.create(model="tiny-mrl", input=TEXTS[:1], dimensions=12)


# -- the README's first requests ------------------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
# The README's requests are written for `make run`'s server: its address, its model's name, no key (a client that
# needs one is given "unused"; huggingface_hub's needs none). Here: this server's address, model and key.
AS_WRITTEN = {
    'base_url="http://127.0.0.1:8000")': f'base_url="URL", api_key="{KEY}")',
    "http://127.0.0.1:8000": "URL",
    '"all-MiniLM-L6-v2"': '"tiny-mrl"',
    'api_key="unused"': f'api_key="{KEY}"',
}
CURL = re.compile(r"^curl -s localhost:8000(/\S*)(?: -d '([^']*)')?", re.M)


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def _as_served(text: str, server: Server) -> str:
    for written, served in AS_WRITTEN.items():
        text = text.replace(written, served.replace("URL", server.url))
    return text


def test_the_readme_curl_requests_are_answered(embedder: Server) -> None:
    calls = [m.groups() for block in _readme_blocks("bash") for m in CURL.finditer(block)]
    # A first request in each API family the README introduces: inferd's own, OpenAI's, Cohere's and TEI's.
    assert {"/health", "/predict", "/v1/encode", "/v1/embeddings", "/v2/embed", "/embed", "/similarity"} <= {
        path for path, _ in calls}, calls
    with embedder.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        for path, body in calls:
            r = client.get(path) if body is None else client.post(path, content=_as_served(body, embedder))
            assert r.status_code == 200, (path, body, r.text)
            assert r.json(), (path, r.text)


def test_the_readme_client_snippets_run(embedder: Server) -> None:
    snippets = _readme_blocks("python")
    assert [s for s in snippets if "from openai import" in s] and [s for s in snippets if "import cohere" in s]
    assert [s for s in snippets if "InferenceClient" in s]
    for snippet in snippets:
        names: dict[str, Any] = {}
        exec(compile(_as_served(snippet, embedder), "README.md", "exec"), names)  # noqa: S102
        got = names.get("vectors", names.get("vector"))
        assert got is not None, snippet
