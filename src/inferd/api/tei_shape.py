"""What every text-embeddings-inference route shares: TEI's error shape, its OpenAPI answers, and its
inputs (texts or token ids refused, pairs with their truncation choices). Not a route module: api/tei.py,
api/tei_tokens.py, api/tei_predict.py and api/inferd_routes.py (TEI's /predict) build on it."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from starlette.responses import Response

from inferd.api import vectors
from inferd.api.answers import ErrorResponse, TEIRerankResult
from inferd.api.client_schemas import (
    TEIError,
    TEIPrediction,
    TEIToken,
)
from inferd.api.errors import APIError, refusal, tei_type
from inferd.core.errors import Kind
from inferd.core.outcomes import TaskResult

# -- TEI's error shape ---------------------------------------------------------------------------------------


def tei_error(exc: APIError) -> Response:
    return Response(orjson.dumps({"error": exc.message, "error_type": tei_type(exc)}), status_code=exc.status,
                    headers=exc.headers, media_type="application/json")


def tei_errors(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A TEI route answers its refusals in TEI's shape."""

    @functools.wraps(route)
    async def answered(request: Request) -> Response:
        try:
            return await route(request)
        except APIError as exc:
            return tei_error(exc)

    return answered


def tei_responses(ok: dict[str, Any], *errors: int) -> dict[int | str, Any]:
    out: dict[int | str, Any] = {200: ok}
    for status in errors:
        if status in (401, 413):  # answered before the route: the one error shape
            out[status] = {"model": ErrorResponse, "description": "Refused before the route (key, body size)"}
        else:
            out[status] = {"model": TEIError, "description": "TEI's error shape"}
    return out


def _array(items: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "array",
                                                                                      "items": items}}}}


VECTORS = _array({"type": "array", "items": {"type": "number"}}, "One vector per input")
SCORES = _array({"type": "number"}, "The cosine similarity of source_sentence with each sentence")
TOKENS = _array({"type": "array", "items": TEIToken.model_json_schema()}, "The tokens of each input")
DECODED = _array({"type": "string"}, "The text of each id list")
PREDICTIONS = {"description": "Labels by score, best first: a list for one input, a list of lists for a batch",
                "content": {"application/json": {"schema": {"type": "array", "items": {"anyOf": [
                    TEIPrediction.model_json_schema(),
                    {"type": "array", "items": TEIPrediction.model_json_schema()}]}}}}}
ANY = {"description": "As /embed, /similarity, /predict or /rerank answer (the served model's task)",
        "content": {"application/json": {"schema": {}}}}
RANKED = _array(TEIRerankResult.model_json_schema(), "Scored texts, best first")


# -- /embed, /similarity -----------------------------------------------------------------------------------


def tei_inputs(inputs: Any, field: str) -> list[Any]:
    """TEI's ``inputs`` (a text, or a list of texts) as a list; token ids are refused (the texts' own rules are
    the engine's request's: core/request.py)."""
    listed = isinstance(inputs, list)
    if listed and inputs and isinstance(inputs[0], int | list) and not isinstance(inputs[0], bool):
        raise refusal(Kind.INVALID_INPUT, f"{field}: token ids are not supported; send text", "unsupported_input",
                      field)
    return inputs if listed else [inputs]


def tei_pairs(query: Any, documents: list[Any]) -> list[tuple[str, str]]:
    """The engine's (query, document) pairs; the request's truncation choices go beside them as the documents'
    options (vectors.options_of: core/preprocess.py PairEncoder, ``left`` cuts a document's start; the query is kept
    whole)."""
    return [(query, d) for d in documents]


def tei_vectors(result: TaskResult, dimensions: int | None, normalize: bool) -> np.ndarray:
    """TEI's /embed answer (and its gRPC Embed's): the result's vectors cut to ``dimensions``, normalised as asked;
    ``normalize: false`` is refused on a model whose own configuration normalises (its vectors cannot be undone)."""
    if not normalize and result.description.normalize:
        raise refusal(Kind.INVALID_INPUT, "normalize: false is not available on this model: its own configuration "
                      "normalises its vectors (a Normalize module, or model.normalize: true)", "invalid_value",
                      "normalize")
    return vectors.vectors_of(result, dimensions, normalize)


def tei_ranks(result: TaskResult, raw_scores: bool) -> list[tuple[int, float]]:
    """TEI's rerank order: each (query, text) pair's index and score (the logit when ``raw_scores``), best first."""
    column = 1 if raw_scores else 0
    scores = [float(o[column]) for o in result.outputs]
    return sorted(enumerate(scores), key=lambda r: -r[1])
