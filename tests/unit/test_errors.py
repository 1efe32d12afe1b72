"""The one table from engine refusal kinds to HTTP (api/errors.py), alone: status, headers, code, param and
the reason a refusal is counted under, and the table from a kind to TEI's error_type. The statuses clients see end
to end are held in tests/integration."""

from __future__ import annotations

from typing import get_args

import pytest

from inferd.api.admin import _refused
from inferd.api.client_schemas import TEIError
from inferd.api.errors import KINDS, TEI_TYPES, APIError, Names, engine_refusal, refusal, tei_type
from inferd.core.backends.base import BackendError
from inferd.core.errors import (
    EngineError,
    Kind,
    ManagerClosed,
    ModelLoadError,
    ModelNotReady,
    NoCanary,
    NoShadow,
    ReloadInProgress,
    ShadowRefused,
    SpaceChanged,
    TaskMismatch,
    VersionInUse,
)
from inferd.utils.metrics import Metrics


def rejected(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("inferd_requests_rejected_total", {"reason": reason}) or 0.0


def test_every_kind_has_an_answer() -> None:
    assert set(KINDS) == set(Kind)


def test_teis_error_type_is_the_refusals_kinds_never_its_statuss() -> None:
    assert set(TEI_TYPES) == set(Kind)
    assert set(TEI_TYPES.values()) <= set(get_args(TEIError.model_fields["error_type"].annotation))
    # Two 503s of different kinds are told apart by their kind; an empty input is TEI's "empty".
    assert tei_type(engine_refusal(EngineError(Kind.OVERLOADED, "full"), Names("inputs"))) == "overloaded"
    assert tei_type(engine_refusal(EngineError(Kind.DRAINING, "stopping"), Names("inputs"))) == "unhealthy"
    empty = EngineError(Kind.INVALID_INPUT, "empty", "empty_string")
    assert tei_type(engine_refusal(empty, Names("inputs"))) == "empty"
    assert tei_type(refusal(Kind.WRONG_TASK, "no rerank model")) == "backend"
    # A refusal the HTTP layer makes of the request as sent (its JSON, its fields) is an invalid input.
    assert tei_type(APIError(400, "not JSON", "invalid_json")) == "validation"
    made = refusal(Kind.NOT_READY, "loading")
    assert (made.status, made.code, made.headers, made.kind) == (503, "model_not_ready", {"Retry-After": "1"},
                                                                 Kind.NOT_READY)


@pytest.mark.parametrize(("kind", "status", "code", "retry_after", "reason"), [
    (Kind.INVALID_INPUT, 422, "invalid_value", None, "invalid"),
    (Kind.TOO_LONG, 422, "text_too_long", None, "too_long"),
    (Kind.WRONG_TASK, 404, "wrong_task", None, None),
    (Kind.NOT_READY, 503, "model_not_ready", "1", "not_ready"),
    (Kind.MODEL_FAILED, 503, "model_failed", "5", "not_ready"),
    (Kind.MODEL_UNLOADED, 503, "model_unloaded", "1", None),
    (Kind.WORKER_DEAD, 503, "worker_dead", "5", None),
    (Kind.OVERLOADED, 503, "queue_full", "1", "overloaded"),
    (Kind.DRAINING, 503, "draining", "1", "draining"),
    (Kind.DEADLINE, 504, "deadline_exceeded", None, "deadline"),
    (Kind.OOM, 507, "out_of_memory", None, "oom"),
    (Kind.FAILED, 500, "inference_error", None, None),
    (Kind.CONFLICT, 409, "conflict", None, None),
])
def test_a_kind_becomes_its_status_headers_code_and_counted_reason(
        kind: Kind, status: int, code: str, retry_after: str | None, reason: str | None) -> None:
    metrics = Metrics()
    err = engine_refusal(EngineError(kind, "why"), Names("input"), metrics)
    assert (err.status, err.code, err.headers.get("Retry-After")) == (status, code, retry_after)
    if status == 422:
        assert (err.param, err.message) == ("input", "input: why")
    else:
        assert (err.param, err.message) == (None, "why")  # only a 422 names a field
    counted = {r: rejected(metrics, r) for r in ("invalid", "too_long", "not_ready", "overloaded", "draining",
                                                  "deadline", "oom")}
    assert counted == {r: float(r == reason) for r in counted}


def test_the_route_names_the_input_at_fault_in_its_own_terms() -> None:
    too_long = EngineError(Kind.TOO_LONG, "is too long", "text_too_long", index=3)
    for field in ("input", "documents", "texts"):
        err = engine_refusal(too_long, Names(field))
        assert (err.param, err.message, err.code) == (f"{field}[3]", f"{field}[3]: is too long", "text_too_long")
    # A single string sent as such is named without an index.
    assert engine_refusal(too_long, Names("input", listed=False)).param == "input"
    # A refusal about another field names that field, whatever the inputs' field is.
    priority = EngineError(Kind.INVALID_INPUT, "too high", "priority_not_allowed", field="priority")
    err = engine_refusal(priority, Names("documents"))
    assert (err.param, err.message, err.code) == ("priority", "priority: too high", "priority_not_allowed")
    # A pair's query by the route's words for it (one shared query, or each pair's own), and another field by the
    # family's name for it (Cohere's output_dimension), on a 422 and on a 404 alike.
    query = EngineError(Kind.INVALID_INPUT, "must not be empty", "empty_string", index=2, field="query")
    assert engine_refusal(query, Names("documents")).param == "query"
    assert engine_refusal(query, Names("inputs", query="inputs[{i}][0]")).message == "inputs[2][0]: must not be empty"
    size = EngineError(Kind.INVALID_INPUT, "not this size", field="dimensions")
    assert engine_refusal(size, Names("texts", fields={"dimensions": "output_dimension"})).param == "output_dimension"
    missing = EngineError(Kind.MODEL_NOT_FOUND, "not served", field="model")
    assert engine_refusal(missing, Names("texts", fields={"model": "model_id"})).param == "model_id"


def test_a_precise_code_wins_over_the_kinds_default() -> None:
    err = engine_refusal(EngineError(Kind.NOT_READY, "loading", "model_loading"), Names("input"))
    assert (err.status, err.code, err.headers) == (503, "model_loading", {"Retry-After": "1"})


@pytest.mark.parametrize(("exc", "status", "code", "param", "retry_after"), [
    (ReloadInProgress("a change of m is in progress"), 409, "reload_in_progress", None, None),
    (VersionInUse("v1", "active"), 409, "version_in_use", "version", None),
    (TaskMismatch("rerank", "embedding", "active"), 409, "task_mismatch", "path", None),
    (SpaceChanged("another space"), 409, "space_changed", "path", None),
    (NoCanary("no canary"), 409, "no_canary", None, None),
    (NoShadow("no shadow"), 409, "no_shadow", None, None),
    (ShadowRefused("shadow_drifted", "drifted"), 409, "shadow_drifted", None, None),
    (ModelNotReady("loading"), 503, "model_not_ready", None, "1"),
    (ManagerClosed("stopping"), 503, "draining", None, "1"),
    (ModelLoadError("no weights"), 422, "model_load_failed", "path", None),
    (BackendError("no openvino"), 422, "model_load_failed", "path", None),
])
def test_a_refused_model_change_is_answered_by_its_kind_as_every_refusal_of_that_kind(
        exc: Exception, status: int, code: str, param: str | None, retry_after: str | None) -> None:
    # The admin API's answers come from KINDS by each exception's kind: a draining 503 carries the same
    # Retry-After on an admin change as on an inference request.
    err = _refused(exc, "reload", Metrics())
    assert (err.status, err.code, err.param, err.headers.get("Retry-After")) == (status, code, param, retry_after)
    assert (err.status, err.headers) == (KINDS[exc.kind].status, refusal(exc.kind, "").headers)  # type: ignore[attr-defined]
