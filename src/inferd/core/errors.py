"""Why the engine refused or failed a request: a kind, in core's own words, never an HTTP status.

The API layer keeps the one table that turns a kind into a status, headers, an error type and a metric
reason (api/errors.py). Core says *what* went wrong and *where*: ``index`` is the input (text or pair) at
fault, ``field`` another request field at fault; each route names them in its own request's terms.

The exceptions of a model's load and changes live here too (a load that failed, a change refused, no slot to
run on): the engine turns some into kinds, the admin API answers the others, and neither imports the manager
for them.
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
    RATE_LIMITED = "rate_limited"  # the caller's tenant is over one of its limits (core/tenant.py)
    CONFLICT = "conflict"  # a model change the model's state refuses (another in progress, no canary, ...)
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
                 field: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.code = kind, message, code
        self.index, self.field = index, field
        # Seconds until a retry can succeed, when the refusal knows (a rate limit): else the kind's default.
        self.retry_after = retry_after
        # The served model the request was routed to, once known (the request metrics' model label).
        self.model: str | None = None

    def __repr__(self) -> str:
        return f"EngineError({self.kind.value!r}, {self.message!r}, code={self.code!r}, index={self.index!r})"


class ModelLoadError(Exception):
    """A model folder (or a backend for it) that cannot be served; the message names the cause.

    Each exception of a model's changes below says how it is answered by its kind, its precise ``code`` and the
    request ``field`` at fault (the admin API answers them through the one table of kinds, api/errors.py)."""

    kind, code, field = Kind.INVALID_INPUT, "model_load_failed", "path"


class ClientGone(Exception):
    """The client went away before its answer was ready; its queued work was dropped."""


def excerpt(text: str, limit: int = 40) -> str:
    """A short excerpt of user input for error messages (never the whole input): a refusal that quoted a client's
    model name or prompt name whole answered (and a gRPC status carried) as much as the body held, a megabyte."""
    return text if len(text) <= limit else text[:limit] + "…"


def deadline_passed() -> EngineError:
    # Seen by the waiter (the deadline's timer) or by the worker (the scheduler's expiry): the same answer.
    return EngineError(Kind.DEADLINE, "the request's deadline passed while it was queued")


# -- a model's changes: why the manager refused one, or cannot serve (the admin API answers each) -----------


class ReloadInProgress(Exception):
    """A model change while another runs: one at a time per model."""

    kind, code, field = Kind.CONFLICT, "reload_in_progress", None


class VersionInUse(ModelLoadError):
    """A model change under a version string that a served slot already carries (refused)."""

    def __init__(self, version: str, role: str) -> None:
        super().__init__(
            f"version {version!r} is already being served by the {role} model; a different model needs a "
            "version of its own (responses, pinning, metrics and the cache tell models apart by it)")
        self.version = version
        self.role = role

    kind, code, field = Kind.CONFLICT, "version_in_use", "version"


class TaskMismatch(ModelLoadError):
    """A model change to a model of another task (refused): clients of one task's routes would break."""

    def __init__(self, new: str, serving: str, role: str) -> None:
        super().__init__(f"the new model is a {new} model; this server serves the {serving} task (the {role} "
                         f"model), and a model change stays within its task: start a {new} server instead")
        self.new, self.serving = new, serving

    kind, code, field = Kind.CONFLICT, "task_mismatch", "path"


class SpaceChanged(ModelLoadError):
    """A canary embedding model whose vectors live in another space than the active model's: clients indexing
    during the canary would store a mixture no query can search. Refused unless forced."""

    kind, code, field = Kind.CONFLICT, "space_changed", "path"


class LoadCancelled(ModelLoadError):
    """A model change abandoned while it loaded (the admin API's cancel): nothing switched, the lock is free."""

    kind, code, field = Kind.CONFLICT, "load_cancelled", None


class LoadTimedOut(ModelLoadError):
    """A model change whose load ran past ``model.load_timeout_s``: abandoned, nothing switched."""

    kind, code, field = Kind.INVALID_INPUT, "load_timed_out", "path"


class NoLoadInProgress(Exception):
    """A cancel with no model change loading (none started, or it has just finished): a state conflict."""

    kind, code, field = Kind.CONFLICT, "no_load_in_progress", None


class ModelNotReady(Exception):
    """No slot to run on: the model is loading, not loaded, failed (``reason``) or closed."""

    def __init__(self, state: str, reason: str | None = None) -> None:
        super().__init__(state)
        self.state = state
        self.reason = reason

    kind, code, field = Kind.NOT_READY, "model_not_ready", None


class ManagerClosed(ModelNotReady):
    """A model change during or after shutdown: refused, or its new slot retired; nothing switched."""

    def __init__(self, reason: str) -> None:
        super().__init__("closed", reason)

    kind, code, field = Kind.DRAINING, "draining", None


class NoCanary(Exception):
    """promote/rollback with no canary slot: a state conflict, not a failed load."""

    kind, code, field = Kind.CONFLICT, "no_canary", None


class NoShadow(Exception):
    """A shadow report, drop or promote with no shadow candidate: a state conflict."""

    kind, code, field = Kind.CONFLICT, "no_shadow", None


class ShadowRefused(Exception):
    """A shadow promotion the drift report does not support (``code``: shadow_drifted, shadow_insufficient,
    or canary_set when a canary is being served), unless forced."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    kind, field = Kind.CONFLICT, None
