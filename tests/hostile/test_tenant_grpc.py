"""Tenants over gRPC (grpc/call.py: the same key, allow-list and limits as HTTP): a stream's read-ahead is the
server's, so it must not make the stream's own messages refuse each other under the tenant's ``max_concurrent``,
and a refusal names only the models the tenant may call.

One real server of a tiny BERT model ``a`` (the default) and ``secret``, and two tenants: ``narrow`` (model ``a``
only) and ``single`` (one request at a time).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from conftest import ROOT, Server
from servers import free_port
from tinymodel import write_tiny_bert

from inferd.grpc.stubs import pb, rpc

KEYS = {"narrow": "narrow-secret-key-0001", "single": "single-secret-key-0002"}
MAX_BATCH = 4  # batching.max_batch_size: a stream reads ahead twice this many messages


@pytest.fixture(scope="module")
def channel(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Iterator[grpc.Channel]:
    tmp = tmp_path_factory.mktemp("tenant-grpc")
    model = write_tiny_bert(tmp / "bert", seed=3)
    (tmp / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", tmp / "configs" / "base.yaml")
    port = free_port()
    (tmp / "configs" / "dev.yaml").write_text(yaml.safe_dump({
        "models": [{"name": "a", "path": str(model)}, {"name": "secret", "path": str(model)}],
        "batching": {"max_batch_size": MAX_BATCH}, "server": {"grpc_port": port}}))
    (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"name": "narrow", "keys": [KEYS["narrow"]], "models": ["a"]},
        {"name": "single", "keys": [KEYS["single"]], "max_concurrent": 1}]}))
    module_serve({"INFERD_CONFIG_DIR": str(tmp / "configs"), "INFERD__MODEL__LOAD_MODE": "eager",
                  "INFERD__SERVER__TENANTS_FILE": str(Path(tmp / "tenants.yaml"))}, wait="/health/ready")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


def auth(tenant: str, *more: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"), *more)


@pytest.mark.parametrize("method", ["EmbedStream", "EmbedAllStream"])
def test_a_stream_of_a_tenant_allowed_one_request_at_a_time_is_answered_whole(channel: grpc.Channel,
                                                                              method: str) -> None:
    """The server reads a stream ahead (2 x batching.max_batch_size messages in the engine at once), each message
    a request of the tenant's: with max_concurrent 1 the read-ahead's second request was refused, and the stream
    of a client that sent nothing at once ended RESOURCE_EXHAUSTED at its second or third answer."""
    embed = rpc.EmbedStub(channel)
    request = pb.EmbedRequest if method == "EmbedStream" else pb.EmbedAllRequest
    texts = [f"text number {i} " * 5 for i in range(4 * MAX_BATCH)]
    answers = list(getattr(embed, method)((request(inputs=t) for t in texts), metadata=auth("single"), timeout=60))
    assert len(answers) == len(texts)


def test_tokenize_stream_of_a_tenant_allowed_one_request_at_a_time_is_answered_whole(channel: grpc.Channel) -> None:
    tokenize = rpc.TokenizeStub(channel)
    texts = [f"text number {i}" for i in range(4 * MAX_BATCH)]
    answers = list(tokenize.TokenizeStream((pb.EncodeRequest(inputs=t) for t in texts), metadata=auth("single"),
                                           timeout=60))
    assert len(answers) == len(texts)


def test_a_model_not_served_is_refused_naming_only_the_models_the_tenant_may_call(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        rpc.EmbedStub(channel).Embed(pb.EmbedRequest(inputs="hello"), metadata=auth("narrow", ("x-model", "nope")),
                                     timeout=30)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details().endswith("the embedding models served: a"), caught.value.details()
