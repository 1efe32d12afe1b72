"""The rerank and classification routes: the shapes their clients send (Cohere/Jina/vLLM, vLLM). TEI's /rerank
is TEI's (api/tei_routes.py), in TEI's error shape.

Each (query, document) pair is one item for the engine, so a request of 100 documents batches with other
requests' pairs; the routes only shape the scores the rerank task returns (``[score, raw logit]`` per pair)
and the probabilities the classification task returns (one per label, in ``id2label`` order).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api.bodies import json_response, read_body
from inferd.api.inference import (
    INFERENCE_ERRORS,
    check_query,
    prechecked,
    require_task,
    run_task,
    served_name,
)
from inferd.api.middleware import context
from inferd.api.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    RerankRequest,
    RerankResponse,
    request_body,
    responses,
)
from inferd.api.services import inference_auth
from inferd.core.work import TaskResult

task_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys, as api/routes.py


def _pairs_checked(request: Request, body: RerankRequest) -> None:
    check_query(request, body.query)
    # Each document is an item: counts toward limits.max_items_per_request, named documents[i] when at fault.
    prechecked(request, body.documents, "documents", True)


def _usage(result: TaskResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}


@task_router.post("/v1/rerank", openapi_extra=request_body(RerankRequest),
                  responses=responses(RerankResponse, *INFERENCE_ERRORS))
@task_router.post("/v2/rerank", openapi_extra=request_body(RerankRequest),
                  responses=responses(RerankResponse, *INFERENCE_ERRORS))
async def rerank(request: Request) -> Response:
    """Cohere / Jina / vLLM / infinity rerank: ``{"query", "documents", "top_n"?, "return_documents"?}``.

    Also on /v2/rerank, where Cohere's v2 client (``cohere.ClientV2``) sends the same body."""
    require_task(request, "rerank")
    body = await read_body(request, RerankRequest, lambda b: _pairs_checked(request, b))
    pairs = [(body.query, d) for d in body.documents]
    result = await run_task(request, pairs, body, "documents", listed=True, task="rerank")
    if isinstance(result, Response):
        return result
    order = sorted(range(len(body.documents)), key=lambda i: -float(result.outputs[i][0]))
    if body.top_n is not None:
        order = order[: body.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": float(result.outputs[i][0])}
        if body.return_documents:
            item["document"] = {"text": body.documents[i]}
        results.append(item)
    return json_response({"id": context(request.scope)["request_id"], "results": results,
                          "model": served_name(result), "usage": _usage(result),
                          "meta": {"billed_units": {"search_units": 1}}})


def _check_classify(request: Request, body: ClassifyRequest) -> None:
    listed = isinstance(body.input, list)
    prechecked(request, body.input if listed else [body.input], "input", listed)


@task_router.post("/v1/classify", openapi_extra=request_body(ClassifyRequest),
                  responses=responses(ClassifyResponse, *INFERENCE_ERRORS))
async def classify(request: Request) -> Response:
    """vLLM's classify: ``{"input": str | [str]}`` → a label and the probability of each label per text."""
    require_task(request, "classification")
    body = await read_body(request, ClassifyRequest, lambda b: _check_classify(request, b))
    listed = isinstance(body.input, list)
    texts = body.input if listed else [body.input]
    result = await run_task(request, texts, body, "input", listed, task="classification")
    if isinstance(result, Response):
        return result
    labels = list(result.description.labels or ())
    data = [{"index": i, "label": labels[int(p.argmax())], "probs": [float(x) for x in p],
             "num_classes": len(labels), "object": "classification"} for i, p in enumerate(result.outputs)]
    return json_response({"id": context(request.scope)["request_id"], "object": "list", "data": data,
                          "model": served_name(result), "usage": _usage(result)})
