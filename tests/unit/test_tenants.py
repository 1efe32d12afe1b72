"""Tenants alone (core/tenants.py, tenant.py, fair_share.py): keys, limits, charges, the fair clock and the
table's reload (no server)."""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import pytest
import yaml

from inferd.core.errors import EngineError, Kind
from inferd.core.tenant import duration
from inferd.core.tenants import DEFAULT_TENANT, Tenancy
from inferd.settings import Settings
from inferd.utils.metrics import Metrics


def table(*tenants: dict, api_keys: tuple[str, ...] = (), tenants_file: Path | None = None,
          models: tuple[dict, ...] = ()) -> Tenancy:
    return Tenancy(Settings.model_validate({"server": {"tenants": list(tenants), "api_keys": list(api_keys),
                                                       "tenants_file": tenants_file}, "models": list(models)}),
                   Metrics())


# Two served models that let a request run at priority 3 (a tenant's default is held to it).
MODELS = ({"name": "m1", "batching": {"max_priority": 3}, "aliases": ["text-embedding-3-small"]},
          {"name": "m2", "batching": {"max_priority": 3}})


def test_keys_resolve_to_their_tenant_hashed_or_not_and_api_keys_are_the_default_tenant() -> None:
    hashed = "sha256:" + hashlib.sha256(b"secret-b").hexdigest()
    t = table({"name": "a", "keys": ["secret-a"]}, {"name": "b", "keys": [hashed]}, api_keys=("legacy",))
    assert t.resolve("secret-a").name == "a"
    assert t.resolve("secret-b").name == "b"
    assert t.resolve("legacy").name == DEFAULT_TENANT
    assert t.resolve(hashed) is None  # the stored hash is not itself a key
    assert t.resolve("secret-") is None and t.resolve(None) is None and t.resolve("") is None
    assert not table().enabled and t.enabled


def test_a_key_of_two_tenants_or_a_name_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="another tenant's"):
        table({"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["k"]})
    with pytest.raises(ValueError, match="'default'"):
        table({"name": "a", "keys": ["k"]}, api_keys=("k",))


def test_models_and_priorities_are_checked_and_the_default_priority_applied() -> None:
    t = table({"name": "a", "keys": ["k"], "models": ["m1"], "priority_ceiling": 3, "default_priority": 2},
              models=MODELS)
    a = t.resolve("k")
    with pytest.raises(EngineError) as exc:
        a.admit("m2", 0)
    assert exc.value.kind is Kind.MODEL_NOT_FOUND and exc.value.field == "model"
    with pytest.raises(EngineError) as exc:
        a.admit("m1", 4)
    assert exc.value.kind is Kind.INVALID_INPUT and exc.value.code == "priority_not_allowed"
    assert a.admit("m1", 0) == 2 and a.admit("m1", 3) == 3
    assert a.refusals == {"model_not_allowed": 1, "priority_not_allowed": 1}


def test_concurrency_and_request_rate_refuse_with_a_retry_time() -> None:
    t = table({"name": "a", "keys": ["k"], "max_concurrent": 2}, {"name": "b", "keys": ["kb"],
                                                                  "requests_per_second": 2})
    a, b = t.resolve("k"), t.resolve("kb")
    a.admit("m", 0)
    a.admit("m", 0)
    with pytest.raises(EngineError) as exc:
        a.admit("m", 0)
    assert exc.value.kind is Kind.RATE_LIMITED
    a.leave()
    a.admit("m", 0)  # a place was given back
    b.admit("m", 0)
    b.admit("m", 0)
    with pytest.raises(EngineError) as exc:
        b.admit("m", 0)
    assert exc.value.kind is Kind.RATE_LIMITED and 0 < exc.value.retry_after <= 0.5 + 1e-2


def test_tokens_are_charged_when_queued_given_back_unless_run_and_counted_when_run() -> None:
    t = table({"name": "a", "keys": ["k"], "tokens_per_minute": 600})
    a, now = t.resolve("k"), time.monotonic()
    a.queue("m", 500, now, 0, 1.0)
    a.done("m", 500, ran=False)  # refused or dropped after it was queued: not charged
    assert a.tokens.refill(time.monotonic()) == pytest.approx(600, abs=1)
    a.queue("m", 550, now, 0, 1.0)
    a.done("m", 550, ran=True)
    a.queue("m", 100, now, 0, 1.0)  # 50 were left: admitted, and the bucket goes below zero (the debt model)
    a.done("m", 100, ran=True)
    with pytest.raises(EngineError) as exc:
        a.admit("m", 0)
    assert exc.value.kind is Kind.RATE_LIMITED and exc.value.retry_after == pytest.approx(5.0, abs=0.2)
    assert a.report()["models"] == {"m": {"requests": 2, "tokens": 650}}
    headers = a.headers(time.monotonic(), exc.value.retry_after)
    assert headers["x-ratelimit-limit-tokens"] == "600" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(headers["Retry-After"]) == math.ceil(exc.value.retry_after)  # whole seconds, never early
    assert 4800 <= int(headers["retry-after-ms"]) <= 5200


def test_durations_are_written_as_openai_writes_them() -> None:
    assert [duration(s) for s in (0.02, 1.5, 360.0)] == ["20ms", "1.5s", "6m0s"]


def test_the_fair_clock_lowers_a_tenant_ahead_of_its_share_and_leaves_one_alone_unchanged() -> None:
    t = table({"name": "flood", "keys": ["kf"], "share": 1}, {"name": "chat", "keys": ["kc"], "share": 3})
    flood, chat, now = t.resolve("kf"), t.resolve("kc"), 100.0
    t.clock("m").seconds_per_token = 0.001
    ranks = [flood.queue("m", 100, now, 0, 1.0) for _ in range(4)]
    # Each of the flood's requests starts 100 tokens x 1 ms / (1/4 of the shares) = 0.4 s after the one before.
    assert ranks == pytest.approx([0.0, -0.4, -0.8, -1.2])
    # Chat, within its share, queues at its own priority: ahead of the flood's backlog.
    assert chat.queue("m", 100, now, 0, 1.0) == 0.0
    # A tenant is never more than its present backlog ahead: answered work is not held against it.
    for _ in range(4):
        flood.done("m", 100, ran=True)
    assert flood.queue("m", 100, now + 0.01, 0, 1.0) == 0.0
    alone = table({"name": "only", "keys": ["k"]}).resolve("k")
    assert [alone.queue("m", 100, now, 5, 1.0) for _ in range(3)] == [5, 5, 5]


def test_the_seconds_per_token_follow_what_the_model_measured() -> None:
    t = table({"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["kb"]})
    a = t.resolve("k")
    for _ in range(20):
        a.queue("m", 50, 0.0, 0, 1.0)
        a.done("m", 50, ran=True, infer_s=0.2, batch_items=2, items=1)  # 2 items of 50 tokens in 0.2 s
    assert t.clock("m").seconds_per_token == pytest.approx(0.002, rel=0.01)


def test_reconfigure_keeps_a_kept_tenant_s_state_and_drops_a_removed_key(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "a", "keys": ["ka"], "tokens_per_minute": 600},
                                                {"name": "b", "keys": ["kb"]}]}))
    t = table(tenants_file=path)
    a = t.resolve("ka")
    a.queue("m", 100, time.monotonic(), 0, 1.0)
    a.done("m", 100, ran=True)
    running = t.resolve("kb")
    path.write_text(yaml.safe_dump({"tenants": [{"name": "a", "keys": ["ka2"], "tokens_per_minute": 600},
                                                {"name": "c", "keys": ["kc"]}]}))
    settings = Settings.model_validate({"server": {"tenants_file": path}})
    assert t.configure(settings) == ["c added", "b removed"]
    assert t.resolve("ka") is None and t.resolve("kb") is None
    assert t.resolve("ka2") is a and a.report()["models"]["m"]["tokens"] == 100  # its usage and bucket kept
    assert a.tokens.refill(time.monotonic()) < 600
    running.leave()  # a request of a removed tenant still holds it and finishes
    path.write_text("tenants: [{name: x}]")
    with pytest.raises(ValueError, match="tenants_file"):
        t.configure(settings)
    assert t.resolve("kc") is not None  # a bad file leaves the table as it was


def test_a_fleet_worker_enforces_its_part_of_each_limit() -> None:
    settings = Settings.model_validate({"server": {"tenant_limits_fraction": 0.25, "tenants": [
        {"name": "a", "keys": ["k"], "requests_per_second": 8, "tokens_per_minute": 1000, "max_concurrent": 3}]}})
    a = Tenancy(settings).resolve("k")
    assert (a.rules.requests_per_second, a.rules.tokens_per_minute, a.rules.max_concurrent) == (2, 250, 1)
    assert a.tokens.capacity == 250 and a.headers(time.monotonic())["x-ratelimit-limit-tokens"] == "250"


def test_a_tenant_s_models_are_served_names_or_aliases_and_an_alias_allows_its_model(tmp_path: Path) -> None:
    """A name neither served nor an alias would refuse the tenant's every request: refused when the settings are
    read (check-config, start) and when a tenants file is re-read (SIGHUP: the table stays as it was)."""
    with pytest.raises(ValueError, match=r"models \['m3'\] are not served"):
        table({"name": "a", "keys": ["k"], "models": ["m1", "m3"]}, models=MODELS)
    t = table({"name": "a", "keys": ["k"], "models": ["text-embedding-3-small"]}, models=MODELS)
    a = t.resolve("k")
    assert a.rules.models == ("m1",) and a.admit("m1", 0) == 0  # admission compares the model's own name
    with pytest.raises(EngineError):
        a.admit("m2", 0)
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "b", "keys": ["kb"], "models": ["m1"]}]}))
    settings = Settings.model_validate({"server": {"tenants_file": path}, "models": list(MODELS)})
    t = Tenancy(settings)
    path.write_text(yaml.safe_dump({"tenants": [{"name": "b", "keys": ["kb"], "models": ["gone"]}]}))
    with pytest.raises(ValueError, match="not served"):
        t.configure(settings)
    assert t.resolve("kb").rules.models == ("m1",)


def test_a_default_priority_is_held_to_what_a_request_may_ask_and_its_models_allow() -> None:
    with pytest.raises(ValueError, match="default_priority"):
        table({"name": "a", "keys": ["k"], "default_priority": 500})
    with pytest.raises(ValueError, match="priority_ceiling"):
        table({"name": "a", "keys": ["k"], "priority_ceiling": -101})
    # The served model runs nothing above batching.max_priority (0 by default): a default of 5 would jump it.
    with pytest.raises(ValueError, match=r"default_priority 5 is above 0.*'all-MiniLM-L6-v2'"):
        table({"name": "a", "keys": ["k"], "default_priority": 5})
    with pytest.raises(ValueError, match="'m3'"):
        table({"name": "a", "keys": ["k"], "default_priority": 2}, models=(*MODELS, {"name": "m3"}))
    # Allowed on m1 and m2 only, both up to 3: a default of 2 is theirs to run.
    t = table({"name": "a", "keys": ["k"], "models": ["m1", "m2"], "default_priority": 2},
              models=(*MODELS, {"name": "m3"}))
    assert t.resolve("k").admit("m2", 0) == 2


def test_a_limit_changed_by_sighup_keeps_the_tenant_s_debt(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "a", "keys": ["ka"], "tokens_per_minute": 1000,
                                                 "requests_per_second": 2}]}))
    settings = Settings.model_validate({"server": {"tenants_file": path}})
    t = Tenancy(settings)
    a = t.resolve("ka")
    a.admit("m", 0)
    a.admit("m", 0)
    a.queue("m", 5000, time.monotonic(), 0, 1.0)  # one large request: 4,000 tokens of debt
    a.done("m", 5000, ran=True)
    path.write_text(yaml.safe_dump({"tenants": [{"name": "a", "keys": ["ka"], "tokens_per_minute": 1001,
                                                 "requests_per_second": 3}]}))
    t.configure(settings)
    assert t.resolve("ka") is a and a.tokens.capacity == 1001
    with pytest.raises(EngineError) as exc:
        a.admit("m", 0)
    # The debt is paid at the new rate: 4,000 tokens at 1,001 a minute, not wiped by the reload.
    assert exc.value.kind is Kind.RATE_LIMITED and exc.value.retry_after == pytest.approx(4000 * 60 / 1001, rel=0.01)
    assert a.requests.level < 1  # nor is the request bucket refilled
    path.write_text(yaml.safe_dump({"tenants": [{"name": "a", "keys": ["ka"], "tokens_per_minute": 10}]}))
    t.configure(settings)
    assert a.tokens.refill(time.monotonic()) < -3999  # a smaller bucket: no fuller than its capacity, debt kept


def test_a_reservation_makes_requests_tokenising_at_once_see_each_other_and_settles_to_the_real_count() -> None:
    """Admission reserves an estimate before tokenising and settles it as the request is queued (core/admission.py):
    the budget goes below zero by at most one request however many tokenise at once."""
    t = table({"name": "a", "keys": ["k"], "tokens_per_minute": 1000})
    a, now = t.resolve("k"), time.monotonic()
    # Three requests tokenising at once, 512 reserved each: the third finds the budget reserved away.
    a.admit("m", 0)
    first = a.reserve(512)
    a.admit("m", 0)
    second = a.reserve(512)
    with pytest.raises(EngineError) as exc:
        a.admit("m", 0)
    assert exc.value.kind is Kind.RATE_LIMITED
    # Settled to the real count (the difference given back); a count within its reservation is always charged.
    a.queue("m", 128, now, 0, 1.0, first)
    a.queue("m", 300, now, 0, 1.0, second)
    assert a.tokens.refill(time.monotonic()) == pytest.approx(1000 - 128 - 300, abs=1)
    # A count beyond its reservation is charged while the budget is above zero (going below by this request) ...
    a.queue("m", 900, now, 0, 1.0, a.reserve(100))
    assert a.tokens.refill(time.monotonic()) == pytest.approx(572 - 900, abs=1)
    # ... and refused once it is spent, its reservation given back: nothing charged.
    level = a.tokens.level
    with pytest.raises(EngineError) as exc:
        a.queue("m", 200, now, 0, 1.0, a.reserve(100))
    assert exc.value.kind is Kind.RATE_LIMITED and exc.value.retry_after > 0
    assert a.tokens.refill(time.monotonic()) == pytest.approx(level, abs=1)
    a.release(a.reserve(300))  # refused or gone before it was queued: given back whole
    assert a.tokens.refill(time.monotonic()) == pytest.approx(level, abs=1)
    assert a.refusals["tokens_per_minute"] == 2
    assert table({"name": "b", "keys": ["kb"]}).resolve("kb").reserve(500) == 0  # no budget: nothing to reserve
