"""Cohere's API: rerank (``POST /v1/rerank``, ``/v2/rerank``: Cohere's shape, which Jina, vLLM and infinity
share) and embed: ``POST /v1/embed`` (``cohere.Client().embed``) and ``POST /v2/embed`` (``cohere.ClientV2()``).

The bodies and answers are the SDK's (cohere/v2/raw_client.py, cohere/types/embed_*response*.py): v1 without
``embedding_types`` answers ``embeddings_floats`` (a list of vectors), with them, and v2 always, answers
``embeddings_by_type`` (an object with one list per type asked: float, int8, uint8, binary, ubinary, base64).
``input_type`` picks the model's prompt (core/prompts.py, on the model load that runs the request; int8 and
uint8 take their ranges from that load too); ``truncate`` NONE refuses texts over
the limit, START cuts their start, END their end; ``output_dimension`` is a Matryoshka size the model declares;
``model`` is a served model's name, as on every route; Cohere's ``priority`` (0 and up, lower first; vLLM's rerank
means the same) runs at -priority on every route here, embed and rerank alike.

Refusals are in Cohere's error shape, ``{"id", "message"}`` (its SDK raises the error class of the status and
keeps the body as ``body``), with inferd's ``error`` object beside it: /v1/rerank is also Jina's, vLLM's and
infinity's route, whose clients read ``error``. A refusal before the route (401 key, 413 body size) keeps the one
shape.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api import documents, vectors
from inferd.api.answers import RerankResponse, responses
from inferd.api.bodies import json_response
from inferd.api.client_schemas import (
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereRerankRequest,
)
from inferd.api.engine_call import INFERENCE_ERRORS, ask_engine, build, read_request, require_task, served_name
from inferd.api.errors import APIError, Names, error_body
from inferd.api.middleware import context
from inferd.api.rerank_chunking import chunking_of, with_span
from inferd.api.schemas import request_body
from inferd.api.services import inference_auth
from inferd.core import quantize
from inferd.core.outcomes import TaskResult
from inferd.core.prompts import Prompt
from inferd.core.request import InferenceRequest
from inferd.core.text_options import Direction

cohere_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys

# How the routes name what the engine refuses: the engine's dimensions are Cohere's output_dimension.
_EMBED = Names("texts", fields={"dimensions": "output_dimension"})
_RERANK = Names("documents")
_TRUNCATE: dict[str | None, tuple[Direction, bool | None]] = {
    None: ("right", None), "END": ("right", True), "START": ("left", True), "NONE": ("right", False)}


def cohere_errors(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A Cohere route answers its refusals in Cohere's shape (``id``, ``message``), inferd's ``error`` beside."""

    @functools.wraps(route)
    async def answered(request: Request) -> Response:
        try:
            return await route(request)
        except APIError as exc:
            body = orjson.loads(error_body(exc.status, exc.message, exc.code, exc.param, exc.type))
            body = {"id": context(request.scope).get("request_id", ""), "message": exc.message, **body}
            return Response(orjson.dumps(body), status_code=exc.status, headers=exc.headers,
                            media_type="application/json")

    return answered


def _priority(cohere: int) -> int:
    """Cohere's priority (0 and up, lower first; the body refuses negatives) as inferd's (higher first): every
    Cohere route maps it here, so a priority means the same on embed and rerank."""
    return -cohere


def _embed_request(request: Request, body: CohereEmbedRequest) -> InferenceRequest:
    if body.images or body.inputs:
        field = "images" if body.images else "inputs"
        raise APIError(422, f"{field}: only texts are embedded here (send texts)", "unsupported_input", field)
    if body.input_type == "image":
        raise APIError(422, "input_type: image is not supported: only texts are embedded here", "invalid_value",
                       "input_type")
    side, truncate = _TRUNCATE[body.truncate]
    quantized = bool({"int8", "uint8"} & set(body.embedding_types or ()))
    return build(request, body.texts, _EMBED, task="embedding", model=body.model, priority=_priority(body.priority),
                 timeout_ms=body.timeout_ms, dimensions=body.output_dimension,
                 prompt=Prompt(input_type=body.input_type, field="input_type"), calibrate=quantized,
                 chunking=documents.chunking_of(body.chunking),
                 text_options=vectors.options_of(side, truncate, body.max_tokens))


async def _embed(request: Request, version: int) -> Response:
    require_task(request, "embedding")
    body, engine_request = await read_request(request, CohereEmbedRequest, lambda b: _embed_request(request, b))
    await documents.check_body_size(request, body.chunking)
    result = await ask_engine(request, engine_request, _EMBED)
    pooled, pieces = documents.taken_apart(result)
    v, by_type = _by_type(pooled, body)
    floats_only = version == 1 and body.embedding_types is None
    answer = {
        "response_type": "embeddings_floats" if floats_only else "embeddings_by_type",
        "id": context(request.scope).get("request_id", ""),
        "embeddings": v if floats_only else by_type,
        "texts": list(body.texts),
        "meta": {"api_version": {"version": str(version)},
                 "billed_units": {"input_tokens": result.prompt_tokens}}}
    if pieces is not None:  # chunking's mode "pieces": each text's pieces, each with its embeddings by type
        answer["pieces"] = [documents.with_spans(result, i, _each_piece(r, body, floats_only), "embeddings")
                            for i, r in enumerate(pieces)]
    return json_response(answer)


def _by_type(result: TaskResult, body: CohereEmbedRequest) -> tuple[np.ndarray, dict[str, Any]]:
    """The vectors (float) and the embeddings by each type asked."""
    v = vectors.vectors_of(result, body.output_dimension)
    by_type: dict[str, Any] = {}
    for kind in dict.fromkeys(body.embedding_types or ["float"]):
        if kind == "float":
            by_type["float"] = v
        elif kind == "base64":
            by_type["base64"] = quantize.as_base64(v)
        elif kind in ("int8", "uint8"):
            ranges = vectors.ranges_for(result, body.output_dimension)
            by_type[kind] = quantize.quantize(v, kind, ranges).astype(np.int16)
        else:
            by_type[kind] = quantize.quantize(v, kind).astype(np.int16)
    return v, by_type


def _each_piece(result: TaskResult, body: CohereEmbedRequest, floats_only: bool) -> list[Any]:
    """Each piece's embeddings as the answer gives a text's: a vector (v1 floats), else one per type asked."""
    v, by_type = _by_type(result, body)
    if floats_only:
        return list(v)
    return [{kind: values[j] for kind, values in by_type.items()} for j in range(len(v))]


@cohere_router.post("/v1/embed", openapi_extra=request_body(CohereEmbedRequest),
                    responses=responses(CohereEmbedResponse, *INFERENCE_ERRORS))
@cohere_errors
async def embed_v1(request: Request) -> Response:
    """Cohere's v1 embed (``cohere.Client(base_url=URL).embed(texts=..., input_type=..., embedding_types=...)``)."""
    return await _embed(request, 1)


@cohere_router.post("/v2/embed", openapi_extra=request_body(CohereEmbedRequest),
                    responses=responses(CohereEmbedResponse, *INFERENCE_ERRORS))
@cohere_errors
async def embed_v2(request: Request) -> Response:
    """Cohere's v2 embed (``cohere.ClientV2(base_url=URL).embed(model=..., input_type=..., embedding_types=...)``)."""
    return await _embed(request, 2)


def _rerank_request(request: Request, body: CohereRerankRequest) -> InferenceRequest:
    # Each document is an item: counts toward limits.max_items_per_request, named documents[i] when at fault.
    return build(request, [(body.query, d) for d in body.documents], _RERANK, task="rerank", model=body.model,
                 priority=_priority(body.priority), timeout_ms=body.timeout_ms, chunking=chunking_of(body.chunking))


def _usage(result: TaskResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}


@cohere_router.post("/v1/rerank", openapi_extra=request_body(CohereRerankRequest),
                  responses=responses(RerankResponse, *INFERENCE_ERRORS))
@cohere_router.post("/v2/rerank", openapi_extra=request_body(CohereRerankRequest),
                  responses=responses(RerankResponse, *INFERENCE_ERRORS))
@cohere_errors
async def rerank(request: Request) -> Response:
    """Cohere / Jina / vLLM / infinity rerank: ``{"query", "documents", "top_n"?, "return_documents"?}``.

    Also on /v2/rerank, where Cohere's v2 client (``cohere.ClientV2``) sends the same body. With ``chunking``, a
    document that does not fit beside the query is scored piece by piece, its result naming the ``span`` that
    scored (api/rerank_chunking.py)."""
    require_task(request, "rerank")
    body, engine_request = await read_request(request, CohereRerankRequest, lambda b: _rerank_request(request, b))
    await documents.check_body_size(request, body.chunking)
    result = await ask_engine(request, engine_request, _RERANK)
    order = sorted(range(len(body.documents)), key=lambda i: -float(result.outputs[i][0]))
    if body.top_n is not None:
        order = order[: body.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": float(result.outputs[i][0])}
        if body.return_documents:
            item["document"] = {"text": body.documents[i]}
        results.append(with_span(item, result.outputs[i]))
    return json_response({"id": context(request.scope)["request_id"], "results": results,
                          "model": served_name(result), "usage": _usage(result),
                          "meta": {"billed_units": {"search_units": 1}}})

