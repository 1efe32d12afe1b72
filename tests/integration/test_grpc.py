"""TEI's gRPC API (tei.v1) on one real server with tiny models: a BERT embedder (``dense``, the embedding default:
vectors and every token's hidden state), a SPLADE model (``splade``: sparse weights), a cross-encoder (rerank), a
classifier and a second BERT embedder (``reloadable``, the model a hot reload changes), behind an API key, with gRPC
on its own port.

A client generated from inferd's proto calls every RPC (each streaming form too) and each answer equals the HTTP
route's for the same input (TEI's /embed, /embed_sparse, /embed_all, /predict, /rerank, /tokenize, /decode, /info);
10,000 texts over one EmbedStream come back in order, none lost; bad input (a malformed message, an oversize one, an
unknown model, an empty text, a bad pair, an id out of the vocabulary) gets a gRPC status with a message and the
server serves on; the key is checked as over HTTP; health and reflection list the services; calls are counted and
logged as HTTP requests are; a stream open across a hot reload of its model is told why it ends; and a call through
``inferd fleet``'s nginx.conf (grpc_pass, rendered for this server as its one worker) answers as the worker does.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import yaml
from conftest import ROOT, Server, free_port, metric_value, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from settingskit import make_settings
from tinymodel import WORDS, _tiny_encoder_config, write_tiny_bert, write_tiny_classifier, write_tiny_cross_encoder
from transformers import BertForMaskedLM

from inferd.fleet import host, render
from inferd.fleet.layout import plan
from inferd.grpc.stubs import pb, rpc

KEY = "grpc-key"
ADMIN = "grpc-admin"
TOL = 1e-5
MAX_MESSAGE = 200_000  # limits.max_body_bytes: a gRPC message's bound too
TEXTS = ["hello world", "the cat is in the house", "a dog and a cat", "river mountain city river"]
AUTH = (("authorization", f"Bearer {KEY}"),)
SPLADE = (*AUTH, ("x-model", "splade"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    tmp = tmp_path_factory.mktemp("grpc-srv")
    config = tmp / "configs"
    config.mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", config / "base.yaml")
    write_tiny_bert(tmp / "reloadable-v2", seed=13)  # what the reload test switches ``reloadable`` to
    BertForMaskedLM(_tiny_encoder_config(tmp / "mlm", 8, 32, 2, 64)).eval().save_pretrained(tmp / "mlm")
    (config / "dev.yaml").write_text(yaml.safe_dump({
        "models": [{"name": "dense", "path": str(write_tiny_bert(tmp / "dense", seed=11))},
                   {"name": "splade", "path": str(tmp / "mlm"), "pooling": "splade"},
                   {"name": "ce", "path": str(write_tiny_cross_encoder(tmp / "ce", seed=3))},
                   {"name": "cls", "path": str(write_tiny_classifier(tmp / "cls", seed=5))},
                   {"name": "reloadable", "path": str(write_tiny_bert(tmp / "reloadable", seed=12)),
                    "root": [str(tmp)]}],
        "limits": {"max_body_bytes": MAX_MESSAGE},
        "server": {"api_keys": [KEY], "admin_key": ADMIN, "grpc_port": free_port()},
        "cache": {"max_entries": 0}}))
    return module_serve({"INFERD_CONFIG_DIR": str(config), "INFERD__MODEL__LOAD_MODE": "eager"},
                        wait="/health/ready", timeout=180)


@pytest.fixture(scope="module")
def channel(server: Server) -> Iterator[grpc.Channel]:
    port = yaml.safe_load((Path(server.env["INFERD_CONFIG_DIR"]) / "dev.yaml").read_text())["server"]["grpc_port"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _post(http: httpx.Client, path: str, body: Any, **headers: str) -> Any:
    r = http.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def _close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), rtol=TOL,
                               atol=TOL)


def _status(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.details(), "a status without a message"
    return caught.value


# -- every RPC against its HTTP route --------------------------------------------------------------------------


def test_embed_sparse_and_all_answer_as_teis_http_routes(channel: grpc.Channel, http: httpx.Client) -> None:
    embed = rpc.EmbedStub(channel)
    for text in TEXTS:
        got = embed.Embed(pb.EmbedRequest(inputs=text), metadata=AUTH)
        _close(got.embeddings, _post(http, "/embed", {"inputs": text})[0])
        assert got.metadata.compute_chars == len(text) and got.metadata.compute_tokens > 0
        sparse = embed.EmbedSparse(pb.EmbedSparseRequest(inputs=text), metadata=SPLADE)
        want = _post(http, "/embed_sparse", {"inputs": text, "model": "splade"})[0]
        assert [v.index for v in sparse.sparse_embeddings] == [w["index"] for w in want]
        _close([v.value for v in sparse.sparse_embeddings], [w["value"] for w in want])
        every = embed.EmbedAll(pb.EmbedAllRequest(inputs=text), metadata=AUTH)
        _close([list(t.embeddings) for t in every.token_embeddings], _post(http, "/embed_all", {"inputs": text})[0])
    # A model by name, with TEI's truncation choices: as OpenAI's route with its model field.
    left = pb.EmbedRequest(inputs=TEXTS[1], truncate=True, truncation_direction=pb.TRUNCATION_DIRECTION_LEFT)
    _close(embed.Embed(left, metadata=(*AUTH, ("x-model", "reloadable"))).embeddings,
           _post(http, "/v1/embeddings", {"input": TEXTS[1], "model": "reloadable"})["data"][0]["embedding"])
    streams = {"EmbedStream": (pb.EmbedRequest, lambda r: list(r.embeddings), "/embed", lambda w: w, "dense"),
               "EmbedSparseStream": (pb.EmbedSparseRequest, lambda r: [v.value for v in r.sparse_embeddings],
                                     "/embed_sparse", lambda w: [v["value"] for v in w], "splade"),
               "EmbedAllStream": (pb.EmbedAllRequest, lambda r: [list(t.embeddings) for t in r.token_embeddings],
                                  "/embed_all", lambda w: w, "dense")}
    for method, (message, read, path, shape, model) in streams.items():
        answers = list(getattr(embed, method)(iter([message(inputs=t) for t in TEXTS]),
                                              metadata=(*AUTH, ("x-model", model))))
        assert len(answers) == len(TEXTS), method
        for text, answer in zip(TEXTS, answers, strict=True):
            named = {"model": model} if model != "dense" else {}  # /embed names no model: dense is the default
            _close(read(answer), shape(_post(http, path, {"inputs": text, **named})[0]))


def test_predict_and_rerank_answer_as_teis_http_routes(channel: grpc.Channel, http: httpx.Client) -> None:
    predict, rerank = rpc.PredictStub(channel), rpc.RerankStub(channel)

    def rows(answer: Any) -> list[tuple[str, float]]:
        return [(p.label, p.score) for p in answer.predictions]

    def same(got: list[tuple[str, float]], want: list[dict[str, Any]]) -> None:
        assert [g[0] for g in got] == [w["label"] for w in want]
        _close([g[1] for g in got], [w["score"] for w in want])

    for text in TEXTS:
        same(rows(predict.Predict(pb.PredictRequest(inputs=text), metadata=AUTH)),
             _post(http, "/predict", {"inputs": text}))
        pair = [TEXTS[0], text]
        for raw in (False, True):
            same(rows(predict.PredictPair(pb.PredictPairRequest(inputs=pair, raw_scores=raw), metadata=AUTH)),
                 _post(http, "/predict", {"inputs": pair, "raw_scores": raw}))
    texts = list(predict.PredictStream(iter([pb.PredictRequest(inputs=t) for t in TEXTS]), metadata=AUTH))
    pairs = list(predict.PredictPairStream(iter([pb.PredictPairRequest(inputs=[TEXTS[0], t]) for t in TEXTS]),
                                           metadata=AUTH))
    for text, by_text, by_pair in zip(TEXTS, texts, pairs, strict=True):
        same(rows(by_text), _post(http, "/predict", {"inputs": text}))
        same(rows(by_pair), _post(http, "/predict", {"inputs": [TEXTS[0], text]}))

    want = _post(http, "/rerank", {"query": "a cat", "texts": TEXTS, "return_text": True})
    for answer in (rerank.Rerank(pb.RerankRequest(query="a cat", texts=TEXTS, return_text=True), metadata=AUTH),
                   rerank.RerankStream(iter([pb.RerankStreamRequest(query="a cat", text=t, return_text=True)
                                             for t in TEXTS]), metadata=AUTH)):
        assert [(r.index, r.text) for r in answer.ranks] == [(w["index"], w["text"]) for w in want]
        _close([r.score for r in answer.ranks], [w["score"] for w in want])
    raw = rerank.Rerank(pb.RerankRequest(query="a cat", texts=TEXTS, raw_scores=True), metadata=AUTH)
    want = _post(http, "/rerank", {"query": "a cat", "texts": TEXTS, "raw_scores": True})
    assert [r.index for r in raw.ranks] == [w["index"] for w in want]
    assert not any(r.HasField("text") for r in raw.ranks)
    _close([r.score for r in raw.ranks], [w["score"] for w in want])


def test_a_rerank_stream_cuts_each_document_as_its_own_message_chose(channel: grpc.Channel,
                                                                       http: httpx.Client) -> None:
    """One engine request, one cut per document (issue 40: the request's text options, one per input): each
    message's document scores as /rerank scores it cut the same way."""
    long = " ".join(TEXTS[1].split() * 10 + TEXTS[3].split() * 10)  # past the cross-encoder's 64 tokens, ends unlike
    sides = {"right": pb.TRUNCATION_DIRECTION_RIGHT, "left": pb.TRUNCATION_DIRECTION_LEFT}
    answer = rpc.RerankStub(channel).RerankStream(iter([
        pb.RerankStreamRequest(query="a cat", text=long, truncate=True, truncation_direction=d)
        for d in sides.values()]), metadata=AUTH)
    got = {r.index: r.score for r in answer.ranks}
    want = [_post(http, "/rerank", {"query": "a cat", "texts": [long], "truncate": True,
                                    "truncation_direction": side})[0]["score"] for side in sides]
    _close([got[0], got[1]], want)
    assert abs(want[0] - want[1]) > 1e-6  # the two cuts score apart: each message's own choice was applied


def test_a_rerank_stream_past_the_item_limit_is_refused_without_waiting_for_its_end(channel: grpc.Channel) -> None:
    """RerankStream answers once the client closes its side, at most limits.max_items_per_request texts: a stream
    that goes past them is refused as the message past the limit arrives, not read on (held in memory) until the
    client closes, which a hostile one never does."""
    stop = threading.Event()

    def messages() -> Iterator[Any]:
        for i in range(257):  # one past the default limit
            yield pb.RerankStreamRequest(query="a cat", text=f"document {i}")
        stop.wait(30)  # the client's side stays open

    try:
        refused = _status(lambda: rpc.RerankStub(channel).RerankStream(messages(), metadata=AUTH, timeout=20))
    finally:
        stop.set()
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT and "256" in refused.details(), refused.details()


def test_tokenize_decode_and_info_answer_as_teis_http_routes(channel: grpc.Channel, http: httpx.Client) -> None:
    tokenize = rpc.TokenizeStub(channel)

    def rows(answer: Any) -> list[dict[str, Any]]:
        return [{"id": t.id, "text": t.text, "special": t.special, "start": t.start if t.HasField("start") else None,
                 "stop": t.stop if t.HasField("stop") else None} for t in answer.tokens]

    for text in TEXTS:
        for special in (True, False):
            assert rows(tokenize.Tokenize(pb.EncodeRequest(inputs=text, add_special_tokens=special),
                                          metadata=AUTH)) == \
                _post(http, "/tokenize", {"inputs": text, "add_special_tokens": special})[0]
    streamed = list(tokenize.TokenizeStream(iter([pb.EncodeRequest(inputs=t, add_special_tokens=True)
                                                  for t in TEXTS]), metadata=AUTH))
    assert [rows(a) for a in streamed] == _post(http, "/tokenize", {"inputs": TEXTS})
    ids = [[t["id"] for t in row] for row in _post(http, "/tokenize", {"inputs": TEXTS})]
    for skip in (True, False):
        want = _post(http, "/decode", {"ids": ids, "skip_special_tokens": skip})
        assert [tokenize.Decode(pb.DecodeRequest(ids=i, skip_special_tokens=skip), metadata=AUTH).text
                for i in ids] == want
        assert [a.text for a in tokenize.DecodeStream(iter([pb.DecodeRequest(ids=i, skip_special_tokens=skip)
                                                            for i in ids]), metadata=AUTH)] == want

    info = rpc.InfoStub(channel).Info(pb.InfoRequest(), metadata=AUTH)
    want = http.get("/info").json()
    assert (info.model_id, info.model_dtype, info.max_input_length, info.max_batch_tokens, info.max_batch_requests,
            info.max_client_batch_size, info.tokenization_workers) == (
        want["model_id"], want["model_dtype"], want["max_input_length"], want["max_batch_tokens"],
        want["max_batch_requests"], want["max_client_batch_size"], want["tokenization_workers"])
    assert info.model_type == pb.MODEL_TYPE_EMBEDDING and "embedding" in want["model_type"]


# -- one stream, many texts --------------------------------------------------------------------------------------


def test_ten_thousand_texts_over_one_stream_come_back_in_order(channel: grpc.Channel, http: httpx.Client) -> None:
    texts = [f"{' '.join(WORDS[i % 23: i % 23 + 1 + i % 7])} {i}" for i in range(10_000)]
    answers = rpc.EmbedStub(channel).EmbedStream(iter(pb.EmbedRequest(inputs=t) for t in texts),
                                                 metadata=(*AUTH, ("x-model", "dense")), timeout=120)
    got = [(a.metadata.compute_chars, list(a.embeddings)) for a in answers]
    assert len(got) == len(texts)
    assert [chars for chars, _ in got] == [len(t) for t in texts]  # each answer is its own text's, in order
    sample = list(range(0, len(texts), 997))
    want = _post(http, "/v1/embeddings", {"input": [texts[i] for i in sample], "model": "dense"})["data"]
    _close([got[i][1] for i in sample], [w["embedding"] for w in want])


# -- refusals --------------------------------------------------------------------------------------------------


def test_bad_input_gets_a_status_with_a_message_and_the_server_serves_on(channel: grpc.Channel) -> None:
    embed = rpc.EmbedStub(channel)
    raw = channel.unary_unary("/tei.v1.Embed/Embed")  # bytes as they are: not a protobuf message
    malformed = _status(lambda: raw(b"\x0a\xff\xff\xff\xff\x0f", metadata=AUTH))
    assert malformed.code() is grpc.StatusCode.INVALID_ARGUMENT and "tei.v1.EmbedRequest" in malformed.details()
    streamed = channel.stream_stream("/tei.v1.Embed/EmbedStream")(
        iter([pb.EmbedRequest(inputs="fine").SerializeToString(), b"\x0a\xff\xff"]), metadata=AUTH)
    assert len(pb.EmbedResponse.FromString(next(streamed)).embeddings) > 0  # the message before it is answered
    assert _status(lambda: next(streamed)).code() is grpc.StatusCode.INVALID_ARGUMENT
    oversize = _status(lambda: embed.Embed(pb.EmbedRequest(inputs="a" * (MAX_MESSAGE + 1)), metadata=AUTH))
    assert oversize.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    unknown = _status(lambda: embed.Embed(pb.EmbedRequest(inputs="hi"), metadata=(*AUTH, ("x-model", "nope"))))
    assert unknown.code() is grpc.StatusCode.NOT_FOUND and "nope" in unknown.details()
    empty = _status(lambda: embed.Embed(pb.EmbedRequest(inputs=""), metadata=AUTH))
    assert empty.code() is grpc.StatusCode.INVALID_ARGUMENT and empty.details().startswith("inputs: ")
    normalised = _status(lambda: embed.Embed(pb.EmbedRequest(inputs="hi", normalize=False), metadata=AUTH))
    assert normalised.code() is grpc.StatusCode.INVALID_ARGUMENT and "normalize" in normalised.details()
    three = _status(lambda: rpc.PredictStub(channel).PredictPair(pb.PredictPairRequest(inputs=["a", "b", "c"]),
                                                                 metadata=AUTH))
    assert three.code() is grpc.StatusCode.INVALID_ARGUMENT
    wrong_task = _status(lambda: rpc.PredictStub(channel).Predict(pb.PredictRequest(inputs="hi"),
                                                                  metadata=(*AUTH, ("x-model", "dense"))))
    assert wrong_task.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
    vocab = _status(lambda: rpc.TokenizeStub(channel).Decode(pb.DecodeRequest(ids=[10**9]), metadata=AUTH))
    assert vocab.code() is grpc.StatusCode.INVALID_ARGUMENT and "ids[0]" in vocab.details()
    # A stream that goes bad mid-way answers what came before, then the status.
    answers = embed.EmbedStream(iter([pb.EmbedRequest(inputs="fine"), pb.EmbedRequest(inputs="")]), metadata=AUTH)
    first = next(answers)
    assert len(first.embeddings) > 0
    assert _status(lambda: next(answers)).code() is grpc.StatusCode.INVALID_ARGUMENT
    assert len(embed.Embed(pb.EmbedRequest(inputs="still serving"), metadata=AUTH).embeddings) > 0


def test_the_key_is_checked_as_over_http_and_health_and_reflection_are_open(channel: grpc.Channel) -> None:
    info = rpc.InfoStub(channel)
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        refused = _status(lambda m=metadata: info.Info(pb.InfoRequest(), metadata=m))
        assert refused.code() is grpc.StatusCode.UNAUTHENTICATED and "API key" in refused.details()
    two = (("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}"))
    assert _status(lambda: info.Info(pb.InfoRequest(), metadata=two)).code() is grpc.StatusCode.INVALID_ARGUMENT
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tei.v1.Embed", "tei.v1.Rerank"):
        got = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert got.status == health_pb2.HealthCheckResponse.SERVING, service
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    [answer] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    listed = {s.name for s in answer.list_services_response.service}
    assert {"tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize",
            "grpc.health.v1.Health"} <= listed
    # Reflection describes what it lists (grpcurl needs the file): inferd's messages live in a pool of their own.
    for symbol in ("tei.v1.Embed", "grpc.health.v1.Health"):
        [found] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=symbol)]))
        assert found.WhichOneof("message_response") == "file_descriptor_response", (symbol, found)


def test_tei_clients_own_stubs_call_inferd_in_the_same_process(channel: grpc.Channel, http: httpx.Client) -> None:
    """tei-client ships stubs generated from text-embeddings-inference's own proto into protobuf's default pool;
    inferd's (the same package, tei.v1) must neither collide with them in one process nor differ on the wire."""
    from tei_client.stubs import tei_pb2 as theirs
    from tei_client.stubs import tei_pb2_grpc as their_rpc

    got = their_rpc.EmbedStub(channel).Embed(theirs.EmbedRequest(inputs=TEXTS[0]), metadata=AUTH)
    want = http.post("/embed", json={"inputs": TEXTS[0]}).json()[0]
    assert np.allclose(np.array(got.embeddings), np.array(want), atol=TOL)
    info = their_rpc.InfoStub(channel).Info(theirs.InfoRequest(), metadata=AUTH)
    assert info.model_type == theirs.ModelType.MODEL_TYPE_EMBEDDING


def test_calls_are_counted_and_logged_as_http_requests(channel: grpc.Channel, server: Server,
                                                       http: httpx.Client) -> None:
    def count(status: str, model: str = "dense") -> float:
        return metric_value(http.get("/metrics").text, "inferd_requests_total", endpoint="/tei.v1.Embed/Embed",
                            status=status, model=model)

    # A text refused before any model is chosen is counted without one, as over HTTP.
    ok, refused = count("OK"), count("INVALID_ARGUMENT", "")
    rid = "grpc-log-check-1"
    call = rpc.EmbedStub(channel).Embed.with_call(pb.EmbedRequest(inputs="counted"),
                                                 metadata=(*AUTH, ("x-request-id", rid)))
    assert ("x-request-id", rid) in call[1].initial_metadata()
    trailing = dict(call[1].trailing_metadata())  # which model version and runtime answered, as HTTP's headers say
    answered = http.post("/embed", json={"inputs": "counted"})
    assert trailing["x-inferd-runtime"] == answered.headers["x-inferd-runtime"] != ""
    assert trailing["x-model-version"] == answered.headers["x-model-version"]
    _status(lambda: rpc.EmbedStub(channel).Embed(pb.EmbedRequest(inputs=" "), metadata=AUTH))
    assert count("OK") == ok + 1
    assert count("INVALID_ARGUMENT", "") == refused + 1
    wait_for(lambda: rid in server.log(), what="the access line")
    line = next(line for line in server.log().splitlines() if rid in line)
    assert "gRPC /tei.v1.Embed/Embed OK" in line and "model=dense" in line


# -- a stream across a hot reload -----------------------------------------------------------------------------


def test_a_stream_open_across_a_reload_of_its_model_is_told_why_it_ends(channel: grpc.Channel,
                                                                        server: Server) -> None:
    sent: queue.Queue[Any] = queue.Queue()
    answers = rpc.EmbedStub(channel).EmbedStream(iter(sent.get, None), metadata=(*AUTH, ("x-model", "reloadable")),
                                                 timeout=120)
    sent.put(pb.EmbedRequest(inputs="before"))
    before = next(answers)
    assert len(before.embeddings) > 0
    folder = Path(server.env["INFERD_CONFIG_DIR"]).parent / "reloadable-v2"
    r = httpx.post(server.url + "/admin/models/reload", json={"model": "reloadable", "path": str(folder),
                                                             "version": "v2"},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    assert r.status_code == 200, r.text
    try:
        sent.put(pb.EmbedRequest(inputs="after"))
        ended = _status(lambda: next(answers))
    finally:
        sent.put(None)
    assert ended.code() is grpc.StatusCode.UNAVAILABLE
    assert "reloadable@" in ended.details() and "reopen the stream" in ended.details()
    # A new stream runs on the version now served.
    fresh = rpc.EmbedStub(channel).EmbedStream(iter([pb.EmbedRequest(inputs="after")]),
                                               metadata=(*AUTH, ("x-model", "reloadable")))
    assert len(next(fresh).embeddings) == len(before.embeddings)


# -- through the fleet's nginx ---------------------------------------------------------------------------------


NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


@pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; .ci/run installs it)")
def test_a_call_through_the_fleets_nginx_grpc_pass_answers_as_the_worker(
        channel: grpc.Channel, server: Server, tmp_path: Path) -> None:
    # inferd fleet's nginx.conf rendered for one worker: this module's server, by its own ports.
    config = yaml.safe_load((Path(server.env["INFERD_CONFIG_DIR"]) / "dev.yaml").read_text())
    listen = free_port()
    settings = make_settings(layered="dev", environ={"INFERD__FLEET__WORKERS": "1", "INFERD__FLEET__GPUS": "",
                                                     "INFERD__FLEET__GRPC_PORT": str(listen)})
    ports = iter([server.port, free_port(), config["server"]["grpc_port"]])
    layout = plan(settings, (), 1, port=lambda: next(ports))
    user, warning = host.nginx_user(None, tmp_path)
    fleet = render.Fleet(settings, layout, tmp_path, free_port(), str(NGINX), "key", user, warning)
    for folder in ("nginx", "logs", "prometheus"):
        (tmp_path / folder).mkdir()
    (tmp_path / "nginx.conf").write_text(render.render_nginx(fleet))
    nginx = subprocess.Popen([NGINX, "-p", f"{tmp_path}/nginx/", "-c", str(tmp_path / "nginx.conf"),
                              "-e", str(tmp_path / "logs" / "nginx-error.log")], start_new_session=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{listen}") as proxied:
            grpc.channel_ready_future(proxied).result(timeout=30)
            text = "through nginx"
            direct = rpc.EmbedStub(channel).Embed(pb.EmbedRequest(inputs=text), metadata=AUTH)
            via = rpc.EmbedStub(proxied).Embed(pb.EmbedRequest(inputs=text), metadata=AUTH, timeout=30)
            _close(via.embeddings, direct.embeddings)
            streamed = list(rpc.EmbedStub(proxied).EmbedStream(iter([pb.EmbedRequest(inputs=t) for t in TEXTS]),
                                                               metadata=AUTH, timeout=30))
            assert len(streamed) == len(TEXTS)
            # The worker's own statuses pass through nginx as they are.
            refused = _status(lambda: rpc.EmbedStub(proxied).Embed(pb.EmbedRequest(inputs="x"), timeout=30))
            assert refused.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        os.killpg(nginx.pid, signal.SIGQUIT)
        nginx.wait(15)


def test_a_stream_open_when_the_server_drains_is_told_why_it_ends(channel: grpc.Channel, server: Server) -> None:
    """Last in this module: it drains the module's server. A stream open at the SIGTERM keeps the answers it had; the
    first message the drain refuses ends it UNAVAILABLE naming the drain (retry elsewhere), never a silent cut."""
    sent: queue.Queue[Any] = queue.Queue()
    answers = rpc.EmbedStub(channel).EmbedStream(iter(sent.get, None), metadata=AUTH, timeout=60)
    sent.put(pb.EmbedRequest(inputs="before"))
    assert len(next(answers).embeddings) > 0
    server.proc.send_signal(signal.SIGTERM)
    ended: grpc.RpcError | None = None
    try:
        for i in range(2000):  # one message at a time until the drain refuses one
            sent.put(pb.EmbedRequest(inputs=f"during {i}"))
            try:
                assert len(next(answers).embeddings) > 0
            except grpc.RpcError as exc:
                ended = exc
                break
    finally:
        sent.put(None)
    assert ended is not None, "the stream outlived the drain"
    assert ended.code() is grpc.StatusCode.UNAVAILABLE, (ended.code(), ended.details())
    assert "drain" in ended.details(), ended.details()
