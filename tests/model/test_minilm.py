"""The real all-MiniLM-L6-v2: numbers match sentence-transformers, and the official openai client works.

The numeric checks run in-process through the same loader the server uses; one real server serves the
openai client round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Server

from inferd.core.loading import load_handler
from inferd.core.spec import spec_from_settings
from inferd.core.tasks.base import Handler
from inferd.core.tasks.embedding import EmbeddingHandler
from inferd.settings import ModelSettings, Settings, resolve_model_path

pytestmark = pytest.mark.model

LONG = " ".join(f"Sentence {i} of a long document about rivers, mountains and the cities built beside them."
                for i in range(40))  # well over the model's 256-token limit
TEXTS = [
    "Hello world",
    "ok",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on a street corner while people walk by.",
    "机器学习是人工智能的一个分支。",
    "今天天气很好，我们去公园散步吧。",
    "Mixed: 東京 is the capital of Japan, population ~14 million!",
    "Émigré naïve café — déjà vu 🙂",
    LONG,
]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return resolve_model_path(ModelSettings())


@pytest.fixture(scope="module")
def handler() -> Iterator[Handler]:
    settings = Settings(model=ModelSettings(device="cpu"))
    h = load_handler(spec_from_settings(settings))
    yield h
    h.close()


def embed(handler: Handler, texts: list[str]) -> np.ndarray:
    return np.asarray(handler.postprocess(handler.infer(handler.preprocess(texts))))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_handler_follows_the_models_own_configuration(handler: Handler) -> None:
    assert handler.dimension == 384
    assert handler.max_seq_length == 256  # sentence_bert_config.json, not the 512 positions of the BERT
    assert isinstance(handler, EmbeddingHandler)
    assert handler.pooling == "mean" and handler.normalize is True
    (long_enc,) = handler.preprocess([LONG])
    assert long_enc.tokens == 256 and long_enc.truncated


def test_embeddings_match_sentence_transformers(handler: Handler, model_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local folder; never ask a hub
    reference = SentenceTransformer(str(model_path), device="cpu").encode(TEXTS, convert_to_numpy=True)
    ours = embed(handler, TEXTS)
    assert ours.shape == reference.shape == (len(TEXTS), 384)
    sims = cosine(ours, reference)
    assert sims.min() >= 0.9999, dict(zip(TEXTS, sims.round(6), strict=True))


def test_the_same_input_ten_times_gives_identical_vectors(handler: Handler) -> None:
    texts = ["determinism matters", "机器学习"]
    first = embed(handler, texts)
    for _ in range(9):
        assert np.array_equal(embed(handler, texts), first)


def test_batch_invariance(handler: Handler) -> None:
    target = "The quick brown fox jumps over the lazy dog."
    alone = embed(handler, [target])[0]
    others = ["ok", LONG, "今天天气很好，我们去公园散步吧。", "A much longer sentence " * 12]
    for position in (0, 2, len(others)):
        batch = others[:position] + [target] + others[position:]
        in_batch = embed(handler, batch)[position]
        assert np.abs(in_batch - alone).max() <= 1e-5, position


# -- the official openai client against a real server ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(module_serve: Callable[..., Server]) -> Server:
    # No model path: the server must find the packaged MiniLM by itself, as `make run` does.
    env = {"INFERD__MODEL__LOAD_MODE": "eager", "INFERD__MODEL__DEVICE": "cpu", "MODEL_PATH": ""}
    return module_serve(env, timeout=120)


def test_openai_client_round_trip(server: Server, handler: Handler) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    texts = TEXTS[:5]
    expected = embed(handler, texts)

    default = client.embeddings.create(input=texts, model="all-MiniLM-L6-v2")  # sends encoding_format=base64
    got = np.array([d.embedding for d in sorted(default.data, key=lambda d: d.index)])
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(
        e.tokens for e in handler.preprocess(texts))
    assert default.model.startswith("all-MiniLM-L6-v2")

    as_float = client.embeddings.create(input=texts[0], model="all-MiniLM-L6-v2", encoding_format="float")
    assert len(as_float.data) == 1
    np.testing.assert_allclose(as_float.data[0].embedding, expected[0], atol=1e-5)

    models = client.models.list()
    # The id is the name a request's model takes; the answer names the version that computed it too.
    assert [f"{m.id}@1" for m in models.data] == [default.model]


def test_openai_client_sees_the_error_shape(server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.embeddings.create(input="", model="all-MiniLM-L6-v2")
    assert info.value.status_code == 422
    assert info.value.code == "empty_string" and info.value.param == "input"
