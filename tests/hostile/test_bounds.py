"""What a client can make the server hold or send back: the result cache's bytes, whatever outputs its texts ask
for, and refusals that quote an id or name from the URL.

The cache was bounded by its entries only; a text's token states (``/embed_all``) or multi-vector output is a vector
per token, so distinct long texts filled ``cache.max_entries`` entries of up to megabytes each. A refusal of an
unknown file, batch or model named in the path or query quoted it whole (up to ``server.max_header_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import Server, metric_value

# A tiny BERT's token states: hidden 32 float32, 128 bytes a token; a text of 100 words, some 13 KB.
HIDDEN_BYTES = 32 * 4
MAX_BYTES = 40_000


@pytest.fixture(scope="module")
def server(tiny_model: Path, module_serve: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    return module_serve({"INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__LOAD_MODE": "eager",
                         "INFERD__CACHE__MAX_ENTRIES": "1000", "INFERD__CACHE__MAX_BYTES": str(MAX_BYTES),
                         "INFERD__JOBS__ENABLED": "true",
                         "INFERD__JOBS__DATA_DIR": str(tmp_path_factory.mktemp("bounds-jobs"))},
                        wait="/health/ready")


def test_token_states_of_distinct_long_texts_stay_within_the_cache_s_byte_bound(server: Server) -> None:
    texts = [" ".join(["hello", "world"] * 50) + f" {i}" for i in range(12)]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for text in texts:
            r = client.post("/embed_all", json={"inputs": text})
            assert r.status_code == 200, r.text
            assert len(r.json()[0]) * HIDDEN_BYTES > MAX_BYTES / 4  # each entry is a good part of the bound
        again = client.post("/embed_all", json={"inputs": texts[-1]})  # the most recent is still there
        exposition = client.get("/metrics").text
    assert again.status_code == 200
    held = metric_value(exposition, "inferd_cache_entries", cache="all-MiniLM-L6-v2")
    assert 1 <= held <= MAX_BYTES // (100 * HIDDEN_BYTES), exposition
    assert metric_value(exposition, "inferd_cache_hits_total", cache="all-MiniLM-L6-v2") >= 1


def test_refusals_of_ids_and_names_in_the_url_quote_an_excerpt(server: Server) -> None:
    mark = "QZX" + "k" * 8000
    with httpx.Client(base_url=server.url, timeout=30) as client:
        answers = [client.get(f"/health/ready?model={mark}"), client.get(f"/v1/files/{mark}"),
                   client.get(f"/v1/files?after={mark}"), client.get(f"/v1/batches/{mark}"),
                   client.post(f"/v1/batches/{mark}/cancel")]
    for r in answers:
        assert 400 <= r.status_code < 500, r.text[:300]
        assert mark[:60] not in r.text and len(r.content) < 1000, r.text[:300]
