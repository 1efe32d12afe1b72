"""The Open Inference Protocol (KServe v2) on a real server of three tiny models (an embedder, a reranker, a
classifier), called with ``tritonclient.http`` as a Triton or KServe user calls it.

Metadata lists each task's tensors; readiness answers per server, model and version; ``infer`` for each task equals
the native route's answer, with the binary tensor extension (tritonclient's default) and with JSON tensors; bad
input (an unknown model, version or output, a wrong datatype or shape, a missing input, bad JSON, a broken binary
body, an empty text) gets the protocol's ``{"error": ...}`` with a 4xx, never a 500; Cohere's /v2/embed is still
Cohere's. The same server answers the protocol over gRPC (``tritonclient.grpc``) as over HTTP.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
import yaml
from conftest import ROOT, Server, free_port, metric_value
from tinymodel import write_tiny_bert
from tritonclient.utils import InferenceServerException

TEXTS = ["hello world", "a dog and a cat in the house", "the weather is nice today", "一个 测试"]
QUERY = "where is the cat"
DOCS = ["the cat sat on the mat", "dogs bark", "a cat in the house", "the weather"]
TOL = 1e-6
# An input of 8 binary bytes: a BYTES element's length (255) that runs past them.
BROKEN = b'{"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":8}}]}'


@pytest.fixture(scope="module")
def server(task_models: Path, tmp_path_factory: pytest.TempPathFactory,
           module_serve: Callable[..., Server]) -> Server:
    tmp = tmp_path_factory.mktemp("oip")
    write_tiny_bert(tmp / "emb", seed=31)
    models = [{"name": "embedder", "path": str(tmp / "emb")}, {"name": "reranker", "path": str(task_models / "ce")},
              {"name": "classifier", "path": str(task_models / "cls")}]
    config = tmp / "configs"
    config.mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", config / "base.yaml")
    (config / "dev.yaml").write_text(yaml.safe_dump({"models": models}, sort_keys=False))
    # The protocol over gRPC too, on the gRPC port beside TEI's services.
    return module_serve({"INFERD_CONFIG_DIR": str(config), "INFERD__MODEL__LOAD_MODE": "eager",
                         "INFERD__CACHE__MAX_ENTRIES": "0", "INFERD__SERVER__GRPC_PORT": str(free_port())},
                        wait="/health/ready")


@pytest.fixture(scope="module")
def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=server.url.removeprefix("http://"))


@pytest.fixture(scope="module")
def grpc_client(server: Server) -> triton_grpc.InferenceServerClient:
    return triton_grpc.InferenceServerClient(url=f"127.0.0.1:{server.env['INFERD__SERVER__GRPC_PORT']}")


def post(server: Server, path: str, body: Any) -> Any:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def texts(name: str, values: list[str], binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput(name, [len(values)], "BYTES")
    return tensor.set_data_from_numpy(np.array(values, dtype=object), binary_data=binary)


def refused(call: Callable[[], Any], status: int, *words: str) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    exc = caught.value
    assert exc.status() == str(status), (exc.status(), exc.message())
    assert all(w in exc.message() for w in words), exc.message()
    return exc.message()


def test_metadata_lists_each_tasks_tensors_and_readiness_answers_per_model_and_version(
        client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = {name: client.get_model_metadata(name) for name in ("embedder", "reranker", "classifier")}
    tensors = {name: ([(t["name"], t["datatype"]) for t in m["inputs"]],
                      [(t["name"], t["datatype"]) for t in m["outputs"]]) for name, m in meta.items()}
    assert tensors == {
        "embedder": ([("text", "BYTES")], [("embedding", "FP32")]),
        "reranker": ([("query", "BYTES"), ("documents", "BYTES")], [("score", "FP32")]),
        "classifier": ([("text", "BYTES")], [("label", "BYTES"), ("score", "FP32"), ("probabilities", "FP32")])}
    assert meta["embedder"]["outputs"][0]["shape"] == [-1, 32]  # the tiny BERT's hidden size
    assert meta["classifier"]["outputs"][2]["shape"] == [-1, 3]  # its three labels
    version = meta["embedder"]["versions"][0]
    assert client.get_model_metadata("embedder", version)["name"] == "embedder"
    assert client.is_model_ready("embedder") and client.is_model_ready("embedder", version)
    assert not client.is_model_ready("embedder", version + "-other")
    assert not client.is_model_ready("nope")
    refused(lambda: client.get_model_metadata("nope"), 404, "'nope' is not served here", "embedder")


def test_infer_equals_each_native_route_in_binary_and_in_json(server: Server,
                                                              client: triton.InferenceServerClient) -> None:
    native = np.array([d["embedding"] for d in post(server, "/v1/embeddings",
                                                    {"model": "embedder", "input": TEXTS})["data"]])
    for binary in (True, False):
        got = client.infer("embedder", [texts("text", TEXTS, binary)],
                           outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)])
        assert got.get_response()["model_name"] == "embedder"
        np.testing.assert_allclose(got.as_numpy("embedding"), native, atol=TOL)

    ranked = post(server, "/rerank", {"model": "reranker", "query": QUERY, "texts": DOCS})
    scores = np.zeros(len(DOCS))
    scores[[r["index"] for r in ranked]] = [r["score"] for r in ranked]
    got = client.infer("reranker", [texts("query", [QUERY]), texts("documents", DOCS, binary=False)])
    np.testing.assert_allclose(got.as_numpy("score"), scores, atol=TOL)

    classified = post(server, "/v1/classify", {"model": "classifier", "input": TEXTS})["data"]
    got = client.infer("classifier", [texts("text", TEXTS)])
    assert [b.decode() for b in got.as_numpy("label")] == [d["label"] for d in classified]
    probs = np.array([d["probs"] for d in classified])
    np.testing.assert_allclose(got.as_numpy("probabilities"), probs, atol=TOL)
    np.testing.assert_allclose(got.as_numpy("score"), probs.max(axis=1), atol=TOL)
    # Only the outputs asked for, each in the form asked for.
    got = client.infer("classifier", [texts("text", TEXTS[:2])], request_id="r-1",
                       outputs=[triton.InferRequestedOutput("label", binary_data=False)])
    assert [o["name"] for o in got.get_response()["outputs"]] == ["label"]
    assert got.get_response()["id"] == "r-1"
    assert got.get_response()["outputs"][0]["data"] == [d["label"] for d in classified[:2]]
    # Counted as every route is, under the route's own label and the model that answered.
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric_value(metrics, "inferd_requests_total", endpoint="/v2/models/{name}/infer",
                        model="classifier", status="200") >= 2


def test_bad_input_gets_the_protocols_error_never_a_500(server: Server,
                                                        client: triton.InferenceServerClient) -> None:
    refused(lambda: client.infer("nope", [texts("text", TEXTS)]), 404, "'nope' is not served here")
    refused(lambda: client.infer("embedder", [texts("text", TEXTS)], model_version="9"), 404, "not '9'")
    floats = triton.InferInput("text", [2], "FP32").set_data_from_numpy(np.zeros(2, dtype=np.float32))
    refused(lambda: client.infer("embedder", [floats]), 400, "datatype FP32", "takes BYTES")
    refused(lambda: client.infer("embedder", [texts("words", TEXTS)]), 400, "missing ['text']")
    refused(lambda: client.infer("reranker", [texts("query", [QUERY, QUERY]), texts("documents", DOCS)]), 400,
            "input 'query'", "one text")
    refused(lambda: client.infer("embedder", [texts("text", TEXTS)],
                                 outputs=[triton.InferRequestedOutput("vector")]), 400, "unknown ['vector']")
    refused(lambda: client.infer("embedder", [texts("text", ["fine", " "])]), 422, "text[1]")
    # The server's limits hold as on every route: a rerank's documents count against limits.max_items_per_request.
    refused(lambda: client.infer("reranker", [texts("query", [QUERY]), texts("documents", ["d"] * 257)]), 422,
            "256")
    # Triton's parameters: a timeout past inferd's longest (in microseconds), a priority level below 0.
    refused(lambda: client.infer("embedder", [texts("text", TEXTS)], timeout=10**12), 422, "parameters.timeout")
    refused(lambda: client.infer("embedder", [texts("text", TEXTS)], priority=-1), 400, "parameters.priority")

    url = server.url + "/v2/models/embedder/infer"
    cases = [
        ({"content": b"{not json"}, "not valid JSON"),
        ({"json": {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": ["a", "b"]}]}},
         "shape [3] holds 3 elements; 2 were sent"),
        ({"json": {"inputs": [{"name": "text", "shape": [2], "datatype": "STRING", "data": ["a", "b"]}]}},
         "is not one of the protocol's"),
        # A datatype that is not a string (a list or an object cannot even be looked up among the protocol's).
        ({"json": {"inputs": [{"name": "text", "shape": [1], "datatype": ["BYTES"], "data": ["a"]}]}},
         "is not one of the protocol's"),
        ({"json": {"inputs": [{"name": "text", "shape": [1], "datatype": {"BYTES": 1}, "data": ["a"]}]}},
         "is not one of the protocol's"),
        ({"json": {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [7]}]}}, "holds strings"),
        ({"json": {"inputs": []}}, "non-empty list"),
        # A binary element whose length runs past the body, and a header length past the body.
        ({"content": BROKEN + b"\xff\x00\x00\x00abcd",
          "headers": {"Inference-Header-Content-Length": str(len(BROKEN))}}, "runs past"),
        ({"content": b"{}", "headers": {"Inference-Header-Content-Length": "99"}}, "Inference-Header-Content-Length"),
    ]
    for kwargs, words in cases:
        r = httpx.post(url, timeout=30, **kwargs)
        assert r.status_code == 400 and set(r.json()) == {"error"} and words in r.json()["error"], (kwargs, r.text)


def test_cohere_v2_routes_are_still_cohere_s(server: Server) -> None:
    body = post(server, "/v2/embed", {"model": "embedder", "texts": TEXTS[:1], "input_type": "search_query",
                                      "embedding_types": ["float"]})
    assert body["response_type"] == "embeddings_by_type" and len(body["embeddings"]["float"]) == 1


def test_over_grpc_tritonclient_gets_the_same_metadata_readiness_and_answers(
        client: triton.InferenceServerClient, grpc_client: triton_grpc.InferenceServerClient) -> None:
    assert grpc_client.is_server_live() and grpc_client.is_server_ready() and grpc_client.is_model_ready("reranker")
    for name in ("embedder", "reranker", "classifier"):
        meta = grpc_client.get_model_metadata(name, as_json=True)
        http = client.get_model_metadata(name)
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in meta["outputs"]] == \
            [(t["name"], t["datatype"], t["shape"]) for t in http["outputs"]]

    def text_input(name: str, values: list[str]) -> triton_grpc.InferInput:
        tensor = triton_grpc.InferInput(name, [len(values)], "BYTES")
        return tensor.set_data_from_numpy(np.array(values, dtype=object))

    got = grpc_client.infer("embedder", [text_input("text", TEXTS)])
    np.testing.assert_allclose(got.as_numpy("embedding"), client.infer("embedder", [texts("text", TEXTS)])
                               .as_numpy("embedding"), atol=TOL)
    got = grpc_client.infer("reranker", [text_input("query", [QUERY]), text_input("documents", DOCS)])
    np.testing.assert_allclose(got.as_numpy("score"), client.infer(
        "reranker", [texts("query", [QUERY]), texts("documents", DOCS)]).as_numpy("score"), atol=TOL)
    got = grpc_client.infer("classifier", [text_input("text", TEXTS)],
                            outputs=[triton_grpc.InferRequestedOutput("label")])
    want = client.infer("classifier", [texts("text", TEXTS)]).as_numpy("label")
    assert list(got.as_numpy("label")) == list(want)
    with pytest.raises(InferenceServerException) as caught:
        grpc_client.infer("nope", [text_input("text", TEXTS)])
    assert "NOT_FOUND" in str(caught.value.status()) and "'nope' is not served here" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        grpc_client.infer("embedder", [text_input("words", TEXTS)])
    assert "INVALID_ARGUMENT" in str(caught.value.status()) and "missing ['text']" in caught.value.message()
