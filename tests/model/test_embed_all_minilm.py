"""TEI's /embed_all on a plain BERT embedder (the real all-MiniLM-L6-v2, mean pooling, no multi-vector head): each
input's last hidden state of every token, [CLS] and [SEP] included, equal to transformers' ``last_hidden_state``
within 1e-4 (issue 41 item 4: it answered 422 before), in TEI's shape (a list per input, one text or many); the
answer's token vectors are held to ``limits.max_multivector_tokens``, refused before the pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import Server

from inferd.settings import ModelSettings, resolve_model_path

pytestmark = pytest.mark.model

TOL = 1e-4
CAP = 600  # token vectors per answer: two 256-token texts fit, three do not
LONG = " ".join(f"Sentence {i} of a long document about rivers and the cities built beside them." for i in range(40))
TEXTS = ["Hello world", "机器学习是人工智能的一个分支。", "Émigré naïve café — déjà vu 🙂", LONG]


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model_path(ModelSettings())


@pytest.fixture(scope="module")
def server(folder: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve({"INFERD__MODEL__PATH": str(folder), "INFERD__MODEL__NAME": "minilm",
                         "INFERD__MODEL__LOAD_MODE": "eager", "INFERD__LIMITS__MAX_MULTIVECTOR_TOKENS": str(CAP)},
                        wait="/health/ready", timeout=180)


@pytest.fixture(scope="module")
def client(server: Server) -> httpx.Client:
    with server.client(timeout=60.0) as c:
        yield c


def last_hidden_states(folder: Path, texts: list[str]) -> list[np.ndarray]:
    """transformers' own forward pass, one text at a time (no padding), cut at the model's 256 tokens."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            enc = tokenizer(text, truncation=True, max_length=256, return_tensors="pt")
            out.append(model(**enc).last_hidden_state[0].numpy())
    return out


def test_embed_all_is_the_last_hidden_state_of_every_token(client: httpx.Client, folder: Path) -> None:
    r = client.post("/embed_all", json={"inputs": TEXTS, "truncate": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert len(got) == len(TEXTS)
    for text, states, ref in zip(TEXTS, got, last_hidden_states(folder, TEXTS), strict=True):
        states = np.asarray(states, dtype=np.float32)
        assert states.shape == ref.shape, text  # every token, the specials included; the long text cut at 256
        np.testing.assert_allclose(states, ref, atol=TOL, err_msg=text)
    # One text is still a list of inputs, as TEI answers; and the dense route is unchanged beside it.
    (one,) = client.post("/embed_all", json={"inputs": "Hello world"}).json()
    np.testing.assert_allclose(one, got[0], atol=TOL)  # alone or in a padded batch
    (dense,) = client.post("/embed", json={"inputs": "Hello world"}).json()
    mean = np.asarray(got[0]).mean(axis=0)
    np.testing.assert_allclose(dense, mean / np.linalg.norm(mean), atol=1e-5)  # mean pooling + Normalize of them


def test_an_answer_over_the_token_vector_cap_is_refused(client: httpx.Client) -> None:
    long = [LONG + f" {i}" for i in range(3)]  # 3 x 256 token vectors > CAP
    r = client.post("/embed_all", json={"inputs": long, "truncate": True})
    assert r.status_code == 422, r.text
    assert "limits.max_multivector_tokens" in r.json()["error"] and r.json()["error_type"] == "validation"
    assert client.post("/embed_all", json={"inputs": long[:2], "truncate": True}).status_code == 200
