"""Why the engine refused or failed a request: a kind, in core's own words, never an HTTP status.

The API layer keeps the one table that turns a kind into a status, headers, an error type and a metric
reason (api/errors.py). Core says *what* went wrong and *where*: ``index`` is the input (text or pair) at
fault, ``field`` another request field at fault; each route names them in its own request's terms.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    INVALID_INPUT = "invalid_input"  # an input or field the model can never take (type, emptiness, counts)
    TOO_LONG = "too_long"  # an input longer than the limits (characters, tokens)
    WRONG_TASK = "wrong_task"  # no model of the route's task is served here
    MODEL_NOT_FOUND = "model_not_found"  # the request names a model not served (for the route's task)
    NOT_READY = "not_ready"  # no model to run on yet (loading, not loaded, shutting down)
    MODEL_FAILED = "model_failed"  # the model failed to load; retrying soon will not help
    MODEL_UNLOADED = "model_unloaded"  # the model this request was routed to went away under it
    WORKER_DEAD = "worker_dead"  # the inference worker stopped
    OVERLOADED = "overloaded"  # the queue is full
    DRAINING = "draining"  # the server is shutting down
    DEADLINE = "deadline"  # the request's deadline passed while it was queued
    OOM = "oom"  # out of device memory even for this input alone
    FAILED = "failed"  # the batch's inference raised


class EngineError(Exception):
    """A refusal or failure of one request.

    ``code`` is the precise machine-readable cause (e.g. which input check failed), when the kind alone
    does not say it; ``index`` is the position of the input at fault among the request's inputs;
    ``field`` names another request field at fault instead (``priority``).
    """

    def __init__(self, kind: Kind, message: str, code: str | None = None, *, index: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.code = kind, message, code
        self.index, self.field = index, field
        # The served model the request was routed to, once known (the request metrics' model label).
        self.model: str | None = None

    def __repr__(self) -> str:
        return f"EngineError({self.kind.value!r}, {self.message!r}, code={self.code!r}, index={self.index!r})"


class ModelLoadError(Exception):
    """A model folder (or a backend for it) that cannot be served; the message names the cause."""


class ClientGone(Exception):
    """The client went away before its answer was ready; its queued work was dropped."""


def deadline_passed() -> EngineError:
    # Seen by the waiter (the deadline's timer) or by the worker (the scheduler's expiry): the same answer.
    return EngineError(Kind.DEADLINE, "the request's deadline passed while it was queued")
