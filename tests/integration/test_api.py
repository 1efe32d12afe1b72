"""Every endpoint and the whole bad-input list, against a real uvicorn process serving a tiny random BERT.

One eager-mode server for the module (it also shows eager start-up: ready as soon as the port answers), and
one with truncation off for the over-long-text refusal.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import Server, metric_value
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

MAX_ITEMS = 4
MAX_CHARS = 2000
MAX_BODY = 16_384
MAX_TOKENS = 128  # the tiny model's max_position_embeddings / sentence_bert_config
LIMITS = {
    "INFERD__LIMITS__MAX_ITEMS_PER_REQUEST": str(MAX_ITEMS),
    "INFERD__LIMITS__MAX_CHARS_PER_TEXT": str(MAX_CHARS),
    "INFERD__LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
}
ERROR_KEYS = {"message", "type", "code", "param"}


def first_answer(server: Server, path: str, timeout: float = 60.0) -> httpx.Response:
    """The first HTTP answer the server gives on `path` (connection refusals until the port opens)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            return httpx.get(server.url + path, timeout=10)
        except httpx.TransportError:
            time.sleep(0.02)
    raise AssertionError(f"the port never answered:\n{server.log()[-4000:]}")


@pytest.fixture(scope="module")
def eager_start(tiny_model: Path, module_serve: Callable[..., Server]) -> tuple[Server, dict]:
    env = {"INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__LOAD_MODE": "eager", **LIMITS}
    server = module_serve(env, wait=None)
    r = first_answer(server, "/health/ready")
    first = {"status": r.status_code, "body": r.json()}
    # The very first inference request must be served too, not refused as "loading".
    p = httpx.post(server.url + "/predict", json={"texts": ["first"]}, timeout=30)
    first["predict"] = p.status_code
    return server, first


@pytest.fixture(scope="module")
def api(eager_start: tuple[Server, dict]) -> Iterator[httpx.Client]:
    with eager_start[0].client() as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split("[")[0] in err["message"], err  # the message names the field too
    if code is not None:
        assert err["code"] == code, err
    assert r.headers["x-request-id"]
    return err


def decode(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    return metric_value(client.get("/metrics").text, name, **labels)


# -- eager mode -----------------------------------------------------------------------------------------------


def test_eager_mode_is_ready_as_soon_as_the_port_answers(eager_start: tuple[Server, dict]) -> None:
    server, first = eager_start
    assert first["status"] == 200 and first["body"]["status"] == "ready", first
    assert first["predict"] == 200
    # The model loaded before uvicorn started listening.
    log = server.log()
    assert log.index("model ready") < log.index("Uvicorn running on")


# -- endpoints ------------------------------------------------------------------------------------------------


def test_predict(api: httpx.Client) -> None:
    r = api.post("/predict", json={"texts": ["hello world", "the cat", "hello world"]})
    assert r.status_code == 200, r.text
    body = r.json()
    vectors = np.array(body["results"])
    assert vectors.shape == (3, 32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # the model says Normalize
    assert not np.allclose(vectors[0], vectors[1])
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-6)
    info = api.get("/info").json()
    assert body["model"] == f"{info['name']}@{info['version']}"


def test_embeddings_float_and_base64_agree_with_predict(api: httpx.Client, tokenizer: Tokenizer) -> None:
    texts = ["hello world", "a dog and a cat in the house"]
    predicted = np.array(api.post("/predict", json={"texts": texts}).json()["results"])
    r = api.post("/v1/embeddings", json={"input": texts, "model": api.get("/info").json()["name"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    floats = np.array([d["embedding"] for d in body["data"]])
    np.testing.assert_allclose(floats, predicted, atol=1e-6)
    tokens = sum(len(tokenizer.encode(t).ids) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    b64 = api.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    assert b64["model"] == body["model"]
    np.testing.assert_allclose(np.stack([decode(d["embedding"]) for d in b64["data"]]), floats, atol=1e-7)


def test_embeddings_single_string_input(api: httpx.Client) -> None:
    body = api.post("/v1/embeddings", json={"input": "hello world"}).json()
    assert len(body["data"]) == 1 and body["data"][0]["index"] == 0
    assert len(body["data"][0]["embedding"]) == 32


def test_embeddings_dimensions_equal_to_the_model_is_accepted(api: httpx.Client) -> None:
    assert api.post("/v1/embeddings", json={"input": "hi", "dimensions": 32}).status_code == 200


def test_models(api: httpx.Client) -> None:
    body = api.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    info = api.get("/info").json()
    assert model["id"] == info["name"] and model["object"] == "model" and model["ready"] is True
    assert [v["version"] for v in model["versions"]] == [info["version"]] and model["task"] == "embedding"
    assert isinstance(model["created"], int) and model["owned_by"]


def test_info(api: httpx.Client) -> None:
    info = api.get("/info").json()
    assert info["state"] == "ready"
    assert (info["dimension"], info["max_seq_length"], info["device"], info["dtype"]) == (
        32, MAX_TOKENS, "cpu", "float32")
    assert info["name"] and info["version"] == "1" and info["inferd_version"]
    assert info["models"][0]["pooling"] == "mean" and info["models"][0]["normalize"] is True


@pytest.mark.parametrize("path", ["/health", "/health/ready"])
def test_readiness(api: httpx.Client, path: str) -> None:
    r = api.get(path)
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_liveness(api: httpx.Client) -> None:
    r = api.get("/health/live")
    assert r.status_code == 200 and r.json()["status"] == "alive"


def test_unknown_route_and_wrong_method_use_the_error_shape(api: httpx.Client) -> None:
    assert_error(api.get("/nope"), 404, code="not_found")
    assert_error(api.get("/predict"), 405)


# -- request id and timing headers ------------------------------------------------------------------------------


def test_request_id_is_echoed(api: httpx.Client) -> None:
    r = api.post("/predict", json={"texts": ["hi"]}, headers={"X-Request-ID": "client-id.42"})
    assert r.headers["x-request-id"] == "client-id.42"


@pytest.mark.parametrize("supplied", [None, "has spaces and ;", "x" * 200])
def test_request_id_is_generated_when_missing_or_unsafe(api: httpx.Client, supplied: str | None) -> None:
    headers = {"X-Request-ID": supplied} if supplied else {}
    ids = {api.get("/health/live", headers=headers).headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/predict", {"texts": ["hi"]}), ("POST", "/predict", {"texts": []}), ("GET", "/nope", None),
    ("GET", "/health/live", None), ("POST", "/v1/embeddings", {"input": "x" * (MAX_BODY + 1)})])
def test_process_time_on_every_response(api: httpx.Client, method: str, path: str, body: dict | None) -> None:
    r = api.request(method, path, json=body)
    assert float(r.headers["x-process-time"]) >= 0
    assert r.headers["x-request-id"]


# -- bad input: the one error shape, the field named, never a 500 -------------------------------------------------


RAW_BAD = [
    ("/predict", b"{not json", "invalid_json"),
    ("/predict", b'{"texts": ["\xff\xfe bad utf-8"]}', "invalid_json"),
    ("/v1/embeddings", b'{"input": "\\ud800"}', "invalid_json"),  # a lone surrogate escape
    ("/predict", b"", "invalid_json"),
    ("/predict", b"[1, 2]", "invalid_json"),
    ("/v1/embeddings", b'{"input": "a"} trailing', "invalid_json"),
]


@pytest.mark.parametrize(("path", "raw", "code"), RAW_BAD)
def test_malformed_bodies_are_400(api: httpx.Client, path: str, raw: bytes, code: str) -> None:
    assert_error(api.post(path, content=raw, headers={"content-type": "application/json"}), 400, code=code)


INVALID = [
    ("/predict", {"texts": "one string"}, "texts", None),
    ("/predict", {"texts": ["ok", 5]}, "texts[1]", "invalid_type"),
    ("/predict", {"texts": [None]}, "texts[0]", "invalid_type"),
    ("/predict", {}, "texts", None),
    ("/predict", {"texts": []}, "texts", "empty_input"),
    ("/predict", {"texts": [""]}, "texts[0]", "empty_string"),
    ("/predict", {"texts": ["ok", " \n "]}, "texts[1]", "empty_string"),
    ("/predict", {"texts": ["a"] * (MAX_ITEMS + 1)}, "texts", "too_many_items"),
    ("/predict", {"texts": ["a"], "colour": "red"}, "colour", None),
    ("/predict", {"texts": ["a"], "priority": "high"}, "priority", None),
    ("/predict", {"texts": ["a"], "timeout_ms": -5}, "timeout_ms", None),
    ("/v1/embeddings", {}, "input", None),
    ("/v1/embeddings", {"input": 5}, "input", "invalid_type"),
    ("/v1/embeddings", {"input": {"text": "a"}}, "input", "invalid_type"),
    ("/v1/embeddings", {"input": ["a", 3]}, "input[1]", "invalid_type"),
    ("/v1/embeddings", {"input": [1, 2, 3]}, "input", "unsupported_input"),
    ("/v1/embeddings", {"input": [[1, 2]]}, "input", "unsupported_input"),
    ("/v1/embeddings", {"input": ""}, "input", "empty_string"),
    ("/v1/embeddings", {"input": []}, "input", "empty_input"),
    ("/v1/embeddings", {"input": ["a"] * (MAX_ITEMS + 1)}, "input", "too_many_items"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format", None),
    ("/v1/embeddings", {"input": "a", "dimensions": 7}, "dimensions", None),
    ("/v1/embeddings", {"input": "a", "dimensions": True}, "dimensions", None),
    ("/v1/embeddings", {"input": "a", "model": 5}, "model", None),
    ("/v1/embeddings", {"input": "a", "extra": 1}, "extra", None),
]


@pytest.mark.parametrize(("path", "body", "param", "code"), INVALID)
def test_invalid_requests_are_422_naming_the_field(api: httpx.Client, path: str, body: dict, param: str,
                                                   code: str | None) -> None:
    assert_error(api.post(path, json=body), 422, param=param, code=code)


def test_body_over_the_limit_is_413(api: httpx.Client) -> None:
    body = b'{"texts": ["' + b"a " * MAX_BODY + b'"]}'
    assert_error(api.post("/predict", content=body, headers={"content-type": "application/json"}), 413,
                 code="body_too_large")


def test_chunked_body_over_the_limit_is_413(api: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"texts": ["'
        for _ in range(MAX_BODY // 1000 + 2):
            yield b"a " * 500
        yield b'"]}'

    r = api.post("/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert_error(r, 413, code="body_too_large")


def test_chunked_body_under_the_limit_is_served(api: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"texts": '
        yield b'["hello", "world"]}'

    r = api.post("/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 200 and len(r.json()["results"]) == 2


def test_over_long_text_is_truncated_at_the_model_limit(api: httpx.Client) -> None:
    long = " ".join(["hello"] * 300)  # 302 tokens, under the character limit
    at_limit = " ".join(["hello"] * (MAX_TOKENS - 2))
    r = api.post("/v1/embeddings", json={"input": [long, at_limit]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 2 * MAX_TOKENS
    np.testing.assert_allclose(body["data"][0]["embedding"], body["data"][1]["embedding"], atol=1e-6)


def test_absurd_text_is_rejected_before_tokenising(api: httpx.Client) -> None:
    preprocessed = metric(api, "inferd_preprocess_duration_seconds_count", version="1")
    err = assert_error(api.post("/predict", json={"texts": ["ok", "x" * (MAX_CHARS + 1)]}), 422, "texts[1]",
                       "text_too_long")
    assert f"limit is {MAX_CHARS}" in err["message"]
    assert metric(api, "inferd_preprocess_duration_seconds_count", version="1") == preprocessed
    assert metric(api, "inferd_requests_rejected_total", reason="too_long") >= 1


def test_errors_echo_at_most_a_short_excerpt(api: httpx.Client) -> None:
    mark = "QZX" + "secret-input-" * 200
    bodies = [
        ("/predict", {"texts": mark}), ("/predict", {"texts": [mark * 2]}), ("/predict", {"texts": [mark, 1]}),
        ("/predict", {mark: 1, "texts": ["a"]}), ("/v1/embeddings", {"input": "a", "encoding_format": mark}),
        ("/v1/embeddings", {"input": "a", "dimensions": mark}), ("/v1/embeddings", {"input": "a", "user": [mark]}),
        # Names the engine looks up: a model, a version of a served model, a prompt (a 404 or 422 quoted them whole).
        ("/v1/embeddings", {"input": "a", "model": mark}), ("/v1/embeddings", {"input": "a", "model": mark + "@1"}),
        ("/v1/embeddings", {"input": "a", "model": "all-MiniLM-L6-v2@" + mark}), ("/v1/embeddings", {"input": "a",
                                                                                         "model": "@" + mark}),
        ("/embed", {"inputs": "a", "prompt_name": mark}), ("/v2/embed", {"texts": ["a"], "model": mark}),
    ]
    for path, body in bodies:
        r = api.post(path, json=body)
        assert 400 <= r.status_code < 500, r.text
        assert mark[:60] not in r.text, r.text[:300]
        assert len(r.content) < 1000
    raw = b'{"texts": ["' + mark.encode() + b'"] oops'
    r = api.post("/predict", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and mark[:60] not in r.text


def test_no_bad_input_is_ever_answered_500(eager_start: tuple[Server, dict], api: httpx.Client) -> None:
    # The whole list again in one go, then the server's own record: no 5xx counted, no traceback logged.
    for path, raw, _ in RAW_BAD:
        api.post(path, content=raw, headers={"content-type": "application/json"})
    for path, body, _, _ in INVALID:
        api.post(path, json=body)
    api.post("/predict", content=(b"a " * 5000 for _ in range(3)), headers={"content-type": "application/json"})
    statuses = {s.labels["status"] for f in text_string_to_metric_families(api.get("/metrics").text)
                for s in f.samples if s.name == "inferd_requests_total"}
    assert {"400", "413", "422"} <= statuses
    assert not any(s.startswith("5") for s in statuses), statuses
    log = eager_start[0].log()
    assert "Traceback" not in log and "unhandled error" not in log


# -- truncation off -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict(tiny_model: Path, module_serve: Callable[..., Server]) -> Iterator[httpx.Client]:
    env = {"INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__LOAD_MODE": "eager",
           "INFERD__MODEL__TRUNCATE": "false", **LIMITS}
    with module_serve(env, wait="/health/ready").client() as client:
        yield client


def test_truncation_off_refuses_over_long_text_stating_the_limit(strict: httpx.Client) -> None:
    at_limit = " ".join(["hello"] * (MAX_TOKENS - 2))
    assert strict.post("/predict", json={"texts": [at_limit]}).status_code == 200
    err = assert_error(strict.post("/predict", json={"texts": [at_limit, at_limit + " world"]}), 422, "texts[1]",
                       "context_length_exceeded")
    assert f"{MAX_TOKENS} tokens" in err["message"]
    assert_error(strict.post("/v1/embeddings", json={"input": at_limit + " world"}), 422, "input",
                 "context_length_exceeded")
