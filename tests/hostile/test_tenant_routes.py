"""The routes beside inference hold a tenant to its rules too (issue 39): /tokenize and /decode show only a model
its allow-list names and count towards its requests per second; /tokenize's answer is bounded
(limits.max_tokenize_tokens); /v1/models and /info list only the models a restricted tenant may call.

One real server of two tiny BERT models (``a``, the default, and ``b``) and three tenants: ``wide`` (no limits),
``narrow`` (model ``b`` only) and ``slow`` (model ``a``, 3 requests per second).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import ROOT, Server
from tinymodel import WORDS, write_tiny_bert

from hostile.conftest import internal_errors

KEYS = {"wide": "wide-secret-key-0001", "narrow": "narrow-secret-key-0002", "slow": "slow-secret-key-0003"}
TOKENIZE_CAP = 64  # limits.max_tokenize_tokens of the server
RATE = 3  # slow's requests per second
ADMIN = "admin-key"


def write_config(tmp: Path, dev: dict[str, Any]) -> None:
    """``tmp``/configs: the repository's base layer and ``dev`` as the dev overlay."""
    (tmp / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "base.yaml", tmp / "configs" / "base.yaml")
    (tmp / "configs" / "dev.yaml").write_text(yaml.safe_dump(dev))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    tmp = tmp_path_factory.mktemp("tenant-routes")
    model = write_tiny_bert(tmp / "bert", seed=3)
    write_config(tmp, {
        "models": [{"name": "a", "path": str(model)}, {"name": "b", "path": str(model), "aliases": ["b-alias"]}],
        "limits": {"max_tokenize_tokens": TOKENIZE_CAP}})
    (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"name": "wide", "keys": [KEYS["wide"]]},
        {"name": "narrow", "keys": [KEYS["narrow"]], "models": ["b"]},
        {"name": "slow", "keys": [KEYS["slow"]], "models": ["a"], "requests_per_second": RATE}]}))
    return module_serve({"INFERD_CONFIG_DIR": str(tmp / "configs"), "INFERD__MODEL__LOAD_MODE": "eager",
                         "INFERD__SERVER__TENANTS_FILE": str(tmp / "tenants.yaml")}, wait="/health/ready")


def call(server: Server, tenant: str, method: str, path: str, body: object = None) -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, timeout=30,
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"})


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"inputs": "hello world"}), ("/decode", {"ids": [5, 6]})])
def test_tokenize_and_decode_show_only_a_model_the_tenant_may_call(server: Server, path: str, body: object) -> None:
    assert call(server, "wide", "POST", path, body).status_code == 200
    refused = call(server, "narrow", "POST", path, body)  # the default model, a, is not on narrow's list
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"] == "model 'a' is not available to this API key", refused.text


def test_tokenize_and_decode_count_towards_the_requests_per_second(server: Server) -> None:
    started = time.monotonic()
    answers = [call(server, "slow", "POST", "/tokenize" if i % 2 else "/decode",
                    {"inputs": "hello"} if i % 2 else {"ids": [5]}) for i in range(10)]
    elapsed = time.monotonic() - started
    passed = [r for r in answers if r.status_code == 200]
    # A bucket of RATE, refilled at RATE per second while the requests were sent; the rest are 429s to retry.
    assert len(passed) <= RATE + RATE * elapsed + 1, [r.status_code for r in answers]
    limited = [r for r in answers if r.status_code == 429]
    assert len(passed) + len(limited) == len(answers) and limited
    assert all(float(r.headers["retry-after"]) >= 1 for r in limited)


def test_a_tokenize_answer_over_its_token_cap_is_refused_naming_it(server: Server) -> None:
    before = internal_errors(server)
    fits = call(server, "wide", "POST", "/tokenize", {"inputs": " ".join(WORDS[:10])})
    assert fits.status_code == 200 and len(fits.json()[0]) <= TOKENIZE_CAP
    refused = call(server, "wide", "POST", "/tokenize", {"inputs": [" ".join(WORDS[:30])] * 4})
    assert refused.status_code == 422, refused.text
    assert "limits.max_tokenize_tokens" in refused.json()["error"] and refused.json()["error_type"] == "validation"
    assert internal_errors(server) == before


def test_the_model_list_and_info_show_a_restricted_tenant_only_its_models(server: Server) -> None:
    every = {m["id"] for m in call(server, "wide", "GET", "/v1/models").json()["data"]}
    assert every == {"a", "b", "b-alias"}
    assert {m["id"] for m in call(server, "narrow", "GET", "/v1/models").json()["data"]} == {"b", "b-alias"}
    assert {m["id"] for m in call(server, "slow", "GET", "/v1/models").json()["data"]} == {"a"}
    info = call(server, "narrow", "GET", "/info").json()
    assert {m["name"] for m in info["models"]} == {"b"}
    # The top level (TEI's fields) describes the first model it may call, never the default it may not.
    assert info["name"] == "b" and info["served_model_name"] == "b", info
    wide = call(server, "wide", "GET", "/info").json()
    assert {m["name"] for m in wide["models"]} == {"a", "b"} and wide["served_model_name"] == "a"


def test_two_authorization_headers_are_refused_whatever_they_hold(server: Server) -> None:
    # The first one won: a request carrying narrow's key behind wide's ran as wide (a proxy checking the last
    # one would have let it through as narrow).
    for pair in ((KEYS["wide"], KEYS["narrow"]), (KEYS["wide"], KEYS["wide"]), ("not-a-key", KEYS["wide"])):
        headers = httpx.Headers([("Authorization", f"Bearer {key}") for key in pair])
        r = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_authorization" and "2 Authorization headers" in r.text


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"input": "hello", "model": "no-such-model"}),
    ("/v1/embed", {"texts": ["hello"], "model": "no-such-model"}),
    ("/v2/embed", {"texts": ["hello"], "model": "no-such-model", "input_type": "search_query",
                   "embedding_types": ["float"]}),
    ("/v1/encode", {"input": ["hello"], "model": "no-such-model"})])
def test_a_model_not_served_is_refused_naming_only_the_models_the_tenant_may_call(
        server: Server, path: str, body: object) -> None:
    """The refusal of an unknown name lists the models served: to a restricted tenant, only those /v1/models shows
    it. It listed every one, so any tenant learnt by one typo what the others are served."""
    refused = call(server, "narrow", "POST", path, body)
    assert refused.status_code == 404, refused.text
    message = refused.json()["error"]["message"]
    assert "not served here" in message and listed(message) == {"b"}, message
    wide = call(server, "wide", "POST", path, body)  # an unrestricted tenant still reads every name
    assert wide.status_code == 404 and listed(wide.json()["error"]["message"]) == {"a", "b"}, wide.text


def listed(message: str) -> set[str]:
    """The model names a refusal lists after its last colon ("...; the embedding models served: a, b")."""
    return {name.strip() for name in message.rsplit(":", 1)[1].split(",")}


@pytest.fixture(scope="module")
def lazy_server(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    """Two lazy models (each loads on its first request): ``a`` for everyone, ``b`` only for ``wide``."""
    tmp = tmp_path_factory.mktemp("tenant-lazy")
    model = write_tiny_bert(tmp / "bert", seed=3)
    write_config(tmp, {"models": [{"name": "a", "path": str(model)}, {"name": "b", "path": str(model)}]})
    (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [
        {"name": "wide", "keys": [KEYS["wide"]]},
        {"name": "narrow", "keys": [KEYS["narrow"]], "models": ["a"]}]}))
    return module_serve({"INFERD_CONFIG_DIR": str(tmp / "configs"), "INFERD__MODEL__LOAD_MODE": "lazy",
                         "INFERD__SERVER__ADMIN_KEY": ADMIN,
                         "INFERD__SERVER__TENANTS_FILE": str(tmp / "tenants.yaml")}, wait="/health/live")


def test_a_lazy_model_the_tenant_may_not_call_is_refused_without_loading_it(lazy_server: Server) -> None:
    """The allow-list is read before the model is loaded: a tenant naming another's lazy model got its 404 only
    after the server had loaded it (its memory, its time, a slot of another tenant's model) on its behalf."""
    refused = call(lazy_server, "narrow", "POST", "/v1/embeddings", {"input": "hello", "model": "b"})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_allowed", refused.text
    models = httpx.get(lazy_server.url + "/admin/models", headers={"Authorization": f"Bearer {ADMIN}"},
                       timeout=10).json()["models"]
    assert {m["name"]: m["slots"] for m in models}["b"] == [], models
    assert call(lazy_server, "narrow", "POST", "/v1/embeddings", {"input": "hello", "model": "a"}).status_code == 200
