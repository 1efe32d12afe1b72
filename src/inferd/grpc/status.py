"""The gRPC status of each kind of refusal: one table from core/errors.py's kinds, as api/errors.py's KINDS is
HTTP's and TEI_TYPES is TEI's error_type (the three tables of the one kind, each family's own words).

The table follows TEI's gRPC server (router/src/grpc/server.rs ``From<ErrorResponse> for Status``) where TEI
has the kind: the input's fault is INVALID_ARGUMENT, an unhealthy model UNAVAILABLE, an overload
RESOURCE_EXHAUSTED, a route of another task FAILED_PRECONDITION; and is finer where inferd's kinds are (a model not
served is NOT_FOUND, a deadline DEADLINE_EXCEEDED, a failed batch INTERNAL). A refusal the HTTP layer's helpers make
(api/errors.py APIError) keeps its kind; one without a kind is the request as sent (INVALID_ARGUMENT), but a key
refused is UNAUTHENTICATED. A kind with a Retry-After sends it as ``retry-after`` trailing metadata (seconds).
"""

from __future__ import annotations

import math

import grpc

from inferd.api.errors import KINDS, APIError
from inferd.core.errors import Kind

Code = grpc.StatusCode

CODES: dict[Kind, Code] = {
    Kind.INVALID_INPUT: Code.INVALID_ARGUMENT,
    Kind.TOO_LONG: Code.INVALID_ARGUMENT,
    Kind.WRONG_TASK: Code.FAILED_PRECONDITION,
    Kind.MODEL_NOT_FOUND: Code.NOT_FOUND,
    Kind.NOT_READY: Code.UNAVAILABLE,
    Kind.MODEL_FAILED: Code.UNAVAILABLE,
    Kind.MODEL_UNLOADED: Code.UNAVAILABLE,
    Kind.WORKER_DEAD: Code.UNAVAILABLE,
    Kind.OVERLOADED: Code.RESOURCE_EXHAUSTED,
    Kind.RATE_LIMITED: Code.RESOURCE_EXHAUSTED,
    Kind.CONFLICT: Code.ABORTED,
    Kind.DRAINING: Code.UNAVAILABLE,
    Kind.DEADLINE: Code.DEADLINE_EXCEEDED,
    Kind.OOM: Code.RESOURCE_EXHAUSTED,
    Kind.FAILED: Code.INTERNAL,
}


class Refused(Exception):
    """An RPC's answer other than OK: its code, its message and trailing metadata (call.py aborts with it)."""

    def __init__(self, code: Code, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


def refused(exc: APIError) -> Refused:
    """An HTTP-layer refusal (an engine refusal named in the request's terms, or a shaping helper's) as a status."""
    if exc.kind is not None:
        code = CODES[exc.kind]
        after = KINDS[exc.kind].retry_after
    else:
        code = Code.UNAUTHENTICATED if exc.status == 401 else Code.INVALID_ARGUMENT
        after = None
    sent = exc.headers.get("Retry-After")
    trailers: tuple[tuple[str, str], ...] = ()
    if sent is not None or after is not None:
        trailers = (("retry-after", sent or str(math.ceil(after or 0))),)
    return Refused(code, exc.message, trailers)
