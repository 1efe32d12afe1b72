"""Tenants against a hostile client: guessing a key by timing, naming another tenant, forging usage (issue 33), one
key configured for two tenants, and learning from the result cache what another tenant sent (issue 39).

Only the Bearer key says who a request is: a header or a body field naming a tenant is not read, and the usage a
tenant is charged is the tokens the model ran, whatever the body claims.
"""

from __future__ import annotations

import hashlib
import hmac
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import Server, wait_for

from hostile.conftest import internal_errors, log_mark
from inferd.core import tenants as tenants_module
from inferd.core.tenants import Tenancy, digest
from inferd.core.text_options import TextOptions
from inferd.settings import Settings

ADMIN = "admin-key"
KEYS = {"alpha": "alpha-secret-key-0001", "beta": "beta-secret-key-0002", "gamma": "gamma-secret-key-0003"}


def test_a_key_is_compared_with_every_key_whatever_matches_so_timing_tells_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time by construction: every lookup makes the same comparisons, of equal-length digests, whether the
    key is wrong, shares a prefix with a real key, or is the first or the last key configured."""
    table = Tenancy(Settings.model_validate({"server": {"tenants": [
        {"name": n, "keys": [k]} for n, k in KEYS.items()], "api_keys": ["legacy-key"]}}))
    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(tenants_module.hmac, "compare_digest", counting)
    guesses = ["x", KEYS["alpha"][:-1], KEYS["alpha"] + "0", KEYS["alpha"], KEYS["gamma"], "legacy-key",
               "a" * 10_000]
    counts = []
    for guess in guesses:
        seen.clear()
        found = table.resolve(guess)
        assert (found is not None) == (guess in (*KEYS.values(), "legacy-key"))
        counts.append(len(seen))
        assert set(seen) == {(len(digest("")), len(digest("")))}  # 32 bytes each, whatever was sent
    assert set(counts) == {len(KEYS) + 1}


def tenants(*extra: dict) -> dict:
    return {"tenants": [*({"name": n, "keys": [k]} for n, k in KEYS.items()), *extra]}


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants()))
    return path


@pytest.fixture(scope="module")
def tenant_server(module_server: Callable[..., Server], tenants_file: Path) -> Server:
    # The result cache on (it is off by default), for what one tenant's hits may tell of another's texts.
    return module_server(INFERD__SERVER__TENANTS_FILE=str(tenants_file), INFERD__SERVER__ADMIN_KEY=ADMIN,
                         INFERD__CACHE__MAX_ENTRIES="1000")


def usage(server: Server) -> dict:
    r = httpx.get(server.url + "/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    return {name: sum(m["tokens"] for m in t["models"].values()) for name, t in r.json()["tenants"].items()}


def test_a_tenant_named_in_a_header_or_the_body_is_not_who_the_request_is(tenant_server: Server) -> None:
    before = usage(tenant_server)
    text = "who pays for this"
    r = httpx.post(tenant_server.url + "/v1/embeddings", timeout=10, json={"input": text, "user": "beta"},
                   headers={"Authorization": f"Bearer {KEYS['alpha']}", "X-Tenant": "beta", "X-Inferd-Tenant": "gamma",
                            "X-Forwarded-User": "beta"})
    assert r.status_code == 200, r.text
    after = usage(tenant_server)
    assert after["alpha"] - before.get("alpha", 0) == len(text)  # the fake runs one token per character
    assert after.get("beta", 0) == before.get("beta", 0) and after.get("gamma", 0) == before.get("gamma", 0)
    # A tenant's name is no key.
    named = httpx.post(tenant_server.url + "/v1/embeddings", json={"input": text},
                       headers={"Authorization": "Bearer beta", "X-Tenant": "beta"}, timeout=10)
    assert named.status_code == 401


@pytest.mark.parametrize("forged", [{"usage": {"prompt_tokens": 0, "total_tokens": 0}},
                                    {"usage": {"prompt_tokens": -1000}}, {"prompt_tokens": 0}])
def test_a_forged_usage_in_the_body_charges_nothing_less_and_answers_the_real_count(
        tenant_server: Server, forged: dict) -> None:
    before, errors = usage(tenant_server), internal_errors(tenant_server)
    text = f"forged usage {uuid.uuid4().hex} "  # a text of its own each time: a cache hit is never charged
    r = httpx.post(tenant_server.url + "/v1/embeddings", json={"input": text, **forged},
                   headers={"Authorization": f"Bearer {KEYS['gamma']}"}, timeout=10)
    after = usage(tenant_server)
    if r.status_code == 200:  # taken, the field unread: the real count, charged and answered
        assert r.json()["usage"]["prompt_tokens"] == len(text)
        assert after["gamma"] - before.get("gamma", 0) == len(text)
    else:  # refused as an unknown field: nothing ran, nothing charged
        assert r.status_code == 422 and r.json()["error"]["param"]
        assert after.get("gamma", 0) == before.get("gamma", 0)
    assert internal_errors(tenant_server) == errors


def test_the_usage_report_is_the_admin_s_only(tenant_server: Server) -> None:
    r = httpx.get(tenant_server.url + "/admin/usage", headers={"Authorization": f"Bearer {KEYS['alpha']}"},
                  timeout=10)
    assert r.status_code == 401


def hashed(key: str, upper: bool = False) -> str:
    hexdigest = hashlib.sha256(key.encode()).hexdigest()
    return "sha256:" + (hexdigest.upper() if upper else hexdigest)


@pytest.mark.parametrize("nu, xi", [(KEYS["alpha"], hashed(KEYS["alpha"])),
                                    (hashed(KEYS["alpha"]), hashed(KEYS["alpha"], upper=True)),
                                    (hashed(KEYS["alpha"], upper=True), KEYS["alpha"])])
def test_one_key_written_two_ways_cannot_belong_to_two_tenants(nu: str, xi: str) -> None:
    """A key and its sha256: hash, or one hash in upper- and lower-case hex, are one key: configured for two tenants
    its requests would resolve to the last (its models, its bill). Refused as the settings are read (check-config,
    start) and in a tenants file, against the other tenants and server.api_keys alike."""
    with pytest.raises(ValueError, match="another tenant's"):
        Settings.model_validate({"server": {"tenants": [{"name": "nu", "keys": [nu]}, {"name": "xi", "keys": [xi]}]}})
    with pytest.raises(ValueError, match="'default'"):
        Tenancy(Settings.model_validate({"server": {"tenants": [{"name": "xi", "keys": [xi]}], "api_keys": [nu]}}))


def test_a_sighup_crossing_two_tenants_through_one_key_is_refused_and_the_old_tenants_keep_serving(
        tenant_server: Server, tenants_file: Path) -> None:
    mark = log_mark(tenant_server)
    crossed = tenants({"name": "xi", "keys": [hashed(KEYS["alpha"], upper=True)]})
    try:
        tenants_file.write_text(yaml.safe_dump(crossed))
        tenant_server.proc.send_signal(signal.SIGHUP)
        line = wait_for(lambda: next((ln for ln in tenant_server.log()[mark:].splitlines()
                                      if "SIGHUP: tenants" in ln or "SIGHUP: the tenants" in ln), None),
                        what="the SIGHUP's tenants")
    finally:
        tenants_file.write_text(yaml.safe_dump(tenants()))
    assert "the tenants are unchanged" in str(line) and "another tenant's" in str(line), line
    before = usage(tenant_server)
    r = httpx.post(tenant_server.url + "/v1/embeddings", json={"input": "whose key is this"},
                   headers={"Authorization": f"Bearer {KEYS['alpha']}"}, timeout=10)
    assert r.status_code == 200, r.text
    after = usage(tenant_server)
    assert "xi" not in after and after["alpha"] - before.get("alpha", 0) == len("whose key is this")


def test_a_cache_hit_never_tells_one_tenant_what_another_sent(tenant_server: Server) -> None:
    """Each tenant has its own cache entries: a text alpha sent runs again for beta, with the same timing headers
    and the same charge as any text beta never sent; only beta's own repeat is a hit."""
    text = f"a secret only alpha sent {uuid.uuid4().hex}"

    def embed(tenant: str) -> httpx.Response:
        r = httpx.post(tenant_server.url + "/v1/embeddings", json={"input": text},
                       headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=10)
        assert r.status_code == 200, r.text
        return r

    first = embed("alpha")
    before = usage(tenant_server)
    probe = embed("beta")
    after = usage(tenant_server)
    assert probe.json()["data"] == first.json()["data"]
    assert {"x-queue-time", "x-inference-time"} <= set(probe.headers)  # computed for beta, as a text never sent
    assert after["beta"] - before.get("beta", 0) == len(text)  # and charged as one
    again = embed("beta")  # beta's own text: a hit (the cache is on), uncharged, without the model's timings
    assert "x-inference-time" not in again.headers and usage(tenant_server)["beta"] == after["beta"]


def test_a_text_holding_a_nul_cannot_plant_its_vector_as_another_text_s_cached_answer(tenant_server: Server) -> None:
    """A cache key was the text followed by its options' suffix (which starts with a NUL): a plain text ending in
    that very suffix had the key of the shorter text sent with those options, so a caller sharing the scope (an
    open server, one tenant's many clients) planted its own vector as the answer to another's request."""
    word = f"planted {uuid.uuid4().hex}"
    suffix = TextOptions(direction="left").key_suffix
    headers = {"Authorization": f"Bearer {KEYS['alpha']}"}
    planted = httpx.post(tenant_server.url + "/embed", json={"inputs": word + suffix}, headers=headers, timeout=10)
    assert planted.status_code == 200, planted.text
    asked = httpx.post(tenant_server.url + "/embed", json={"inputs": word, "truncation_direction": "left"},
                       headers=headers, timeout=10)
    assert asked.status_code == 200, asked.text
    assert "x-inference-time" in asked.headers  # computed, not the planted entry
    assert asked.json() != planted.json()
