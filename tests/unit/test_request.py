"""core/request.py: every rule that needs no model, each answered by its kind and what it names (a field, an input's
index), and a request that cannot be made without them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from inferd.core.errors import EngineError, Kind
from inferd.core.prompts import Prompt
from inferd.core.request import InferenceRequest, Limits
from inferd.core.tenants import Tenancy
from inferd.core.text_options import InputOptions, TextOptions
from inferd.settings import Settings

LIMITS = Limits(max_items=4, max_chars=20, max_queue=3)
# Whose request it is: a tenant the route's key check found (api/security.py), carried as it is.
ACME = Tenancy(Settings.model_validate({"server": {"tenants": [{"name": "acme", "keys": ["k"]}]}})).resolve("k")


def refused(inputs: Any = ("a text",), **options: Any) -> EngineError:
    with pytest.raises(EngineError) as caught:
        InferenceRequest.build(LIMITS, list(inputs) if isinstance(inputs, tuple) else inputs, **options)
    return caught.value


def what(exc: EngineError) -> tuple[Kind, str | None, str | None, int | None]:
    return exc.kind, exc.code, exc.field, exc.index


@pytest.mark.parametrize(("inputs", "expected"), [
    ("one text", (Kind.INVALID_INPUT, "invalid_type", None, None)),  # a bare string is not a list of them
    ([], (Kind.INVALID_INPUT, "empty_input", None, None)),
    (["a"] * 5, (Kind.INVALID_INPUT, "too_many_items", None, None)),  # limits.max_items_per_request
    (["ok", 7], (Kind.INVALID_INPUT, "invalid_type", None, 1)),
    (["ok", "ok", "  \n"], (Kind.INVALID_INPUT, "empty_string", None, 2)),
    (["x" * 21], (Kind.TOO_LONG, "text_too_long", None, 0)),
    # A pair among texts, a text among pairs: every input of one request is of one kind.
    ([("q", "d"), "d"], (Kind.INVALID_INPUT, "invalid_type", None, 1)),
    ([("q", "d"), ("q", "")], (Kind.INVALID_INPUT, "empty_string", None, 1)),
    ([("q", "d"), ("q", "d" * 21)], (Kind.TOO_LONG, "text_too_long", None, 1)),
    # A pair's query is named as the query, at its pair's index.
    ([("q", "d"), ("", "d")], (Kind.INVALID_INPUT, "empty_string", "query", 1)),
    ([("q" * 21, "d")], (Kind.TOO_LONG, "text_too_long", "query", 0)),
    ([(None, "d")], (Kind.INVALID_INPUT, "invalid_type", "query", 0)),
])
def test_each_input_rule_answers_its_kind_and_the_input_at_fault(inputs: Any, expected: tuple) -> None:
    assert what(refused(inputs)) == expected


def test_more_inputs_than_any_queue_holds_are_refused_as_never_fitting() -> None:
    exc = refused(["a", "b", "c", "d"])  # within max_items (4), over the largest queue (3)
    assert what(exc) == (Kind.INVALID_INPUT, "too_many_items", None, None)
    assert "batching.max_queue" in exc.message


def test_a_request_carries_its_text_options_beside_its_texts() -> None:
    """Issue 40: how each text is encoded travels as one typed value beside the plain texts, shared by every text
    or one per text; a request whose options do not match its texts one for one is never built."""
    shared = InputOptions(TextOptions(direction="left"))
    made = InferenceRequest.build(LIMITS, ["a", "b"], text_options=shared)
    assert made.inputs == ("a", "b") and type(made.inputs[0]) is str and made.text_options is shared
    assert InferenceRequest.build(LIMITS, ["a"]).text_options.plain
    with pytest.raises(ValueError, match="1 text options for 2 inputs"):
        InferenceRequest.build(LIMITS, ["a", "b"], text_options=InputOptions(each=(TextOptions(),)))


@pytest.mark.parametrize(("options", "field"), [
    ({"priority": 101}, "priority"),
    ({"priority": -101}, "priority"),
    ({"priority": True}, "priority"),
    ({"timeout_ms": 0}, "timeout_ms"),
    ({"timeout_ms": -5.0}, "timeout_ms"),
    ({"timeout_ms": float("inf")}, "timeout_ms"),
    ({"timeout_ms": float("nan")}, "timeout_ms"),
    ({"timeout_ms": 600_001}, "timeout_ms"),
    ({"timeout_ms": True}, "timeout_ms"),
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": -8}, "dimensions"),
    ({"dimensions": True}, "dimensions"),
    ({"model": "name@"}, "model"),
    ({"model": "@v1"}, "model"),
    ({"model": ""}, "model"),
    ({"prompt": Prompt(input_type="search_everything", field="input_type")}, "input_type"),
    ({"prompt": Prompt(" ", field="parameters.prompt_name")}, "parameters.prompt_name"),
    ({"outputs": ()}, "outputs"),
    ({"outputs": ("dense", "dense")}, "outputs"),
    ({"outputs": ("colours",)}, "outputs"),
])
def test_each_field_rule_names_the_field_the_route_sent(options: dict[str, Any], field: str) -> None:
    exc = refused(**options)
    assert (exc.kind, exc.field, exc.index) == (Kind.INVALID_INPUT, field, None), exc.message


def test_a_built_request_is_frozen_and_carries_what_was_asked() -> None:
    made = InferenceRequest.build(LIMITS, [("q", "a"), ("q", "b")], task="rerank", model="ce@v2", priority=-3,
                                  timeout_ms=250, routing_key="user-7", outputs=["dense", "sparse"], tenant=ACME)
    assert made.inputs == (("q", "a"), ("q", "b")) and made.pairs
    assert (made.model, made.version, made.priority, made.timeout_ms) == ("ce", "v2", -3, 250)
    assert (made.outputs, made.tenant, made.routing_key, made.calibrate) == (("dense", "sparse"), ACME, "user-7",
                                                                             False)
    assert InferenceRequest.build(LIMITS, ["t"], model="plain").version is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.priority = 100  # type: ignore[misc]


def test_a_request_is_only_made_validated() -> None:
    with pytest.raises(TypeError, match="InferenceRequest.build"):
        InferenceRequest(("",), priority=10_000)
