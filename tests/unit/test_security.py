"""Bearer parsing and key comparison, alone: what counts as a key, what a refusal looks like."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from inferd.api import security
from inferd.api.errors import APIError
from inferd.api.security import bearer_token, key_matches, require_admin, require_keys
from inferd.utils.metrics import Metrics


def request(authorization: str | None = None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode("latin-1"))]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer k1", "k1"),
    ("bearer k1", "k1"),
    ("BEARER   k1  ", "k1"),
    (None, None),
    ("", None),
    ("Bearer", None),
    ("Bearer    ", None),
    ("Basic azE6", None),
    ("k1", None),
    ("Bearer k1 k2", None),
])
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(request(header)) == token


@pytest.mark.parametrize(("token", "ok"), [
    ("secret-1", True),
    ("secret-2", True),
    ("secret-", False),      # a prefix
    ("secret-10", False),    # a key plus more
    ("SECRET-1", False),
    ("", False),
    (None, False),
])
def test_key_matches_exactly_one_of_the_keys(token: str | None, ok: bool) -> None:
    assert key_matches(token, ("secret-1", "secret-2")) is ok


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real = security.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", counting)
    keys = ("first", "a-much-longer-second-key", "3")
    assert key_matches("first", keys)
    assert key_matches("nope", keys) is False
    # No early exit on a match, and equal-length inputs: the time spent does not depend on the keys.
    assert len(calls) == 6 and {n for pair in calls for n in pair} == {32}


def test_no_keys_configured_means_open() -> None:
    require_keys(request(), (), "inference")
    require_keys(request("Bearer anything"), (), "inference")


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic k1", "k1", "Bearer"])
def test_missing_wrong_and_malformed_keys_get_the_same_401(header: str | None) -> None:
    metrics = Metrics()
    with pytest.raises(APIError) as caught:
        require_keys(request(header), ("k1",), "inference", metrics)
    err = caught.value
    assert (err.status, err.code, err.type) == (401, "invalid_api_key", "authentication_error")
    assert err.headers == {"WWW-Authenticate": "Bearer"}
    assert err.message == "a valid API key is required for inference: send 'Authorization: Bearer <key>'"
    assert metrics.registry.get_sample_value("inferd_requests_rejected_total", {"reason": "unauthorized"}) == 1


def test_the_right_key_passes() -> None:
    require_keys(request("Bearer k2"), ("k1", "k2"), "inference")


def test_admin_routes_do_not_exist_without_an_admin_key() -> None:
    for key in (None, ""):
        with pytest.raises(APIError) as caught:
            require_admin(request("Bearer anything"), key)
        assert caught.value.status == 404


def test_admin_key_checks() -> None:
    require_admin(request("Bearer adm"), "adm")
    for header in (None, "Bearer adm2", "Bearer ad", "Basic adm"):
        with pytest.raises(APIError) as caught:
            require_admin(request(header), "adm")
        assert caught.value.status == 401 and caught.value.headers["WWW-Authenticate"] == "Bearer"
