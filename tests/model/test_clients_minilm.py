"""The real all-MiniLM-L6-v2 behind the TEI, Cohere and OpenAI clients, against sentence-transformers' encode.

The packaged folder is copied and given what a retrieval model's folder declares: prompts (with a default)
and a Matryoshka model card. Vectors equal ``encode(..., prompt_name=..., truncate_dim=...,
normalize_embeddings=True)`` (≤ 1e-5); binary outputs equal ``encode(..., precision="ubinary")`` up to a sign
bit of a component within float noise of zero; int8 equals ``quantize_embeddings`` with the calibration
texts' ranges up to a bucket edge.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cohere
import numpy as np
import openai
import pytest
from conftest import Server
from huggingface_hub import InferenceClient
from prompted import add_prompts, sentence_transformer
from sentence_transformers.quantization import quantize_embeddings

from inferd.core import quantize
from inferd.settings import ModelSettings, resolve_model_path

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("hub_client_online")]

TOL = 1e-5
PROMPTS = {"query": "Represent this sentence for searching relevant passages: ", "document": ""}
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "机器学习是人工智能的一个分支。",
         " ".join(f"Sentence {i} of a long document about rivers and the cities beside them." for i in range(40))]
CARD = """---
library_name: sentence-transformers
tags:
- sentence-transformers
- loss:MatryoshkaLoss
---
```json
{"loss": "MultipleNegativesRankingLoss", "matryoshka_dims": [384, 256, 128, 64]}
```
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    shutil.copytree(resolve_model_path(ModelSettings()), target)
    add_prompts(target, PROMPTS, default="query")
    (target / "README.md").write_text(CARD, encoding="utf-8")
    return target


@pytest.fixture(scope="module")
def server(folder: Path, module_serve: Callable[..., Server]) -> Server:
    return module_serve({
        "INFERD__MODEL__PATH": str(folder), "INFERD__MODEL__NAME": "minilm", "INFERD__MODEL__LOAD_MODE": "eager",
        "INFERD__RUNTIME__TORCH_THREADS": "2"}, wait="/health/ready", timeout=180)


@pytest.fixture(scope="module")
def st(folder: Path) -> Any:
    model = sentence_transformer(folder)
    assert model.default_prompt_name == "query"
    return model


def test_tei_embed_with_the_default_prompt_a_named_prompt_and_a_matryoshka_size(server: Server, st: Any) -> None:
    client = InferenceClient(base_url=server.url, timeout=60)
    # No prompt named: the default one (query), as encode() applies it.
    np.testing.assert_allclose(client.feature_extraction(TEXTS[1])[0], st.encode(TEXTS[1]), atol=TOL)
    got = client.feature_extraction(TEXTS[0], prompt_name="document", dimensions=128)[0]
    want = st.encode(TEXTS[0], prompt_name="document", truncate_dim=128, normalize_embeddings=True)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_cohere_types_equal_encodes_precisions(server: Server, st: Any) -> None:
    client = cohere.ClientV2(api_key="none", base_url=server.url, timeout=120)
    got = client.embed(model="minilm", texts=TEXTS, input_type="search_query", output_dimension=256,
                       embedding_types=["float", "ubinary", "binary", "int8"])
    want = st.encode(TEXTS, prompt_name="query", truncate_dim=256, normalize_embeddings=True)
    np.testing.assert_allclose(got.embeddings.float_, want, atol=TOL)
    for kind in ("ubinary", "binary"):
        reference = st.encode(TEXTS, prompt_name="query", truncate_dim=256, precision=kind)
        bits = np.unpackbits(np.asarray(getattr(got.embeddings, kind)).astype(np.uint8), axis=1)
        flipped = bits != np.unpackbits(reference.astype(np.uint8), axis=1)
        # A flip only where the component is within float noise of zero.
        assert np.all(np.abs(want[flipped]) < 1e-5), want[flipped]
    # The calibration texts are embedded as they are, with no prompt (not even the default one).
    calibrated = st.encode(quantize.calibration_texts(None), prompt="", truncate_dim=256, normalize_embeddings=True)
    reference = quantize_embeddings(want, "int8", calibration_embeddings=calibrated)
    diff = np.abs(np.asarray(got.embeddings.int8, dtype=np.int64) - reference.astype(np.int64))
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99


def test_openai_dimensions(server: Server, st: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60)
    got = client.embeddings.create(model="minilm", input=TEXTS, dimensions=64)
    want = st.encode(TEXTS, truncate_dim=64, normalize_embeddings=True)  # the default prompt applies here too
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, atol=TOL)
