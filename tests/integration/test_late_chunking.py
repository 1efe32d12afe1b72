"""Late chunking (issue 41 item 2; core/late_chunking.py): each piece's vector is the mean of the token states inside
its span, from one forward pass over the window of whole pieces around it, equal to a direct computation
(transformers' hidden states over the window, mean-pooled per span by the tokenizer's own offsets, normalised)
within 1e-5 on torch and 1e-4 on ONNX Runtime and OpenVINO; a document longer than the window runs in windows; and
through a real server, ``chunking: {"mode": "late"}`` answers every piece with its exact span, while a model that
cannot (CLS pooling) is refused with 422 naming why, before any work.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import Server
from tinymodel import CJK, WORDS, write_tiny_bert

from inferd.core.chunking import split
from inferd.core.description import ModelDescription
from inferd.core.late_chunking import plan
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.core.text_options import InputOptions, TextOptions

PIECE = 24  # tokens per piece: several pieces per 64-token window
WINDOW = 64


def document(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14)))
        out.append(f"{words}{rng.choice(CJK)}." if i % 4 == 3 else f"{words.capitalize()}.")
    return " ".join(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("late") / "tiny", seed=11)


def direct(folder: Path, window: str, spans: list[tuple[int, int]]) -> np.ndarray:
    """transformers alone: the window's last hidden states, each span's tokens (by the tokenizer's offsets)
    averaged, normalised."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    enc = tokenizer(window, return_offsets_mapping=True, return_special_tokens_mask=True, return_tensors="pt")
    offsets, special = enc.pop("offset_mapping")[0].numpy(), enc.pop("special_tokens_mask")[0].numpy()
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state[0].numpy().astype(np.float64)
    out = []
    for a, b in spans:
        inside = (special == 0) & (offsets[:, 0] < b) & (offsets[:, 1] > a)
        v = hidden[inside].mean(axis=0)
        out.append(v / np.linalg.norm(v))
    return np.asarray(out)


@pytest.mark.parametrize(("backend", "tol"), [("torch", 1e-5), ("onnx", 1e-4), ("openvino", 1e-4)])
def test_late_chunked_pieces_equal_a_direct_computation(tiny: Path, tmp_path: Path, backend: str, tol: float) -> None:
    spec = ModelSpec(path=tiny, name="tiny", version="1", device="cpu", backend=backend, cache_dir=str(tmp_path),
                     gate=(("texts", 32),), warmup=False, max_seq_length=WINDOW)
    handler = load_handler(spec)
    try:
        text = document(3, 30)
        pieces = split(text, handler.tokenizer, max_tokens=PIECE)
        late = plan([text], [pieces], handler.tokenizer, "", WINDOW)
        (windows,) = late.plans
        assert len(windows) >= 3  # longer than the window: several passes, each piece in exactly one
        assert [i for w in windows for i in range(w.first, w.last + 1)] == list(range(len(pieces)))
        inputs = [t for _, t in late.inputs]
        encoded = handler.preprocess(inputs, InputOptions(TextOptions(outputs=("token_states",))))
        assert max(e.tokens for e in encoded) <= WINDOW and not any(e.truncated for e in encoded)
        states = handler.postprocess(handler.infer(encoded))
        description = ModelDescription("tiny", "1", 1, str(tiny), "embedding", pooling=handler.pooling,
                                       normalize=handler.normalize)
        ((vectors, pooled),) = late.answers(states, description)
        want = []
        for w in windows:
            window = text[w.start:w.end]
            want.extend(direct(tiny, window, [(p.start - w.start, p.end - w.start)
                                              for p in pieces[w.first:w.last + 1]]))
        np.testing.assert_allclose(np.asarray(vectors), np.asarray(want), atol=tol)
        # Late, not early: a piece's vector is not the piece embedded alone (it saw its neighbours).
        alone = handler.infer(handler.preprocess([text[pieces[1].start:pieces[1].end]]))[0]
        assert float(np.dot(alone, vectors[1])) < 0.9999
        weights = np.asarray([p.tokens for p in pieces], dtype=np.float64)
        mean = (np.asarray(vectors) * weights[:, None]).sum(axis=0) / weights.sum()
        np.testing.assert_allclose(pooled, mean / np.linalg.norm(mean), atol=1e-6)
    finally:
        handler.close()


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    cls = write_tiny_bert(tmp_path_factory.mktemp("late-cls") / "cls", seed=12, pooling="cls")
    config = tmp_path_factory.mktemp("late-config")
    (config / "base.yaml").write_text((Path(__file__).resolve().parents[2] / "configs" / "base.yaml").read_text())
    import yaml

    (config / "dev.yaml").write_text(yaml.safe_dump({
        "models": [{"name": "tiny", "path": str(tiny), "max_seq_length": WINDOW},
                   {"name": "cls", "path": str(cls)}]}))
    return module_serve({"INFERD_CONFIG_DIR": str(config), "INFERD__MODEL__LOAD_MODE": "eager"},
                        wait="/health/ready", timeout=180)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=60.0) as c:
        yield c


def test_a_late_chunked_request_answers_every_piece_with_its_span(client: httpx.Client, tiny: Path) -> None:
    texts = [document(5, 24), "短い text 🙂 " + document(6, 10)]
    r = client.post("/v1/embeddings", json={"input": texts, "model": "tiny",
                                            "chunking": {"mode": "late", "max_tokens": PIECE}})
    assert r.status_code == 200, r.text
    for text, item in zip(texts, r.json()["data"], strict=True):
        pieces = item["pieces"]
        assert len(pieces) > 3
        assert all(text[p["start"]:p["end"]].strip() for p in pieces)
        vectors = np.asarray([p["embedding"] for p in pieces])
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # The first window's pieces, directly: the server's windows hold the same whole pieces (they are planned alike).
    text = texts[0]
    got = r.json()["data"][0]["pieces"]
    from transformers import AutoTokenizer

    late = plan([text], [split(text, AutoTokenizer.from_pretrained(tiny), max_tokens=PIECE)],
                AutoTokenizer.from_pretrained(tiny), "", WINDOW)
    first = late.plans[0][0]
    spans = [(p["start"] - first.start, p["end"] - first.start) for p in got[first.first:first.last + 1]]
    want = direct(tiny, text[first.start:first.end], spans)
    np.testing.assert_allclose([p["embedding"] for p in got[: len(want)]], want, atol=1e-5)


def test_a_text_of_no_token_late_chunked_gets_a_vector_not_nan(client: httpx.Client) -> None:
    """Zero-width characters tokenise to nothing: the window held only its special tokens, and the piece's mean of
    no token was a vector of NaN (null in JSON), answered 200."""
    r = client.post("/v1/embeddings", json={"input": ["\u200b\u200b", "a word"], "model": "tiny",
                                            "chunking": {"mode": "late"}})
    assert r.status_code == 200, r.text
    for item in r.json()["data"]:
        vector = np.asarray(item["embedding"], dtype=np.float64)
        assert np.isfinite(vector).all() and abs(np.linalg.norm(vector) - 1.0) < 1e-5, item["embedding"][:4]


def test_a_model_that_cannot_late_chunk_is_refused_naming_why(client: httpx.Client) -> None:
    r = client.post("/v1/embeddings", json={"input": document(7, 20), "model": "cls", "chunking": {"mode": "late"}})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "late_chunking_unsupported" and error["param"] == "chunking.mode"
    assert "pooling 'cls'" in error["message"] and "saw the whole window" in error["message"]
