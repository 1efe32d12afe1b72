"""inferd's own inference routes: the seed's ``/predict`` (each task's natural result; a body in TEI's shape is
TEI's /predict, api/tei_predict.py) and ``/v1/classify`` (vLLM's shape: a label and each label's probability)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api.bodies import json_response, read_body
from inferd.api.errors import APIError
from inferd.api.inference import (
    INFERENCE_ERRORS,
    check_query,
    prechecked,
    require_task,
    run_task,
    served_name,
    task_of,
)
from inferd.api.middleware import context
from inferd.api.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    PredictRequest,
    PredictResponse,
    request_body,
    responses,
)
from inferd.api.services import inference_auth
from inferd.api.tei_predict import is_tei_predict, tei_predict
from inferd.core.work import TaskResult

router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys


@router.post("/predict", openapi_extra=request_body(PredictRequest),
             responses=responses(PredictResponse, *INFERENCE_ERRORS))
async def predict(request: Request) -> Response:
    """The seed's endpoint, each task's natural result: ``{"texts": [...]}`` → ``{"results": [...], "model"}``.

    embedding: a vector per text; classification: ``{"label", "probs"}`` per text; rerank: ``texts`` holds
    ``[query, document]`` pairs and each gets its score. A body with ``inputs`` (and no ``texts``) is
    text-embeddings-inference's /predict (api/tei_predict.py).
    """
    if await is_tei_predict(request):
        return await tei_predict(request)
    task = "embedding"

    def check(body: PredictRequest) -> None:
        nonlocal task
        task = task_of(request, body.model)  # the named model's (or the default model's) task sets the shape
        if task == "rerank":
            _check_pairs(request, body)
        else:
            prechecked(request, body.texts, "texts", True)

    body = await read_body(request, PredictRequest, check)
    if task == "rerank":
        return await _predict_pairs(request, body)
    result = await run_task(request, body.texts, body, "texts", listed=True, task=task)
    if isinstance(result, Response):
        return result
    outputs: list[Any] = result.outputs
    if task == "classification":
        labels = list(result.description.labels or ())
        outputs = [{"label": labels[int(p.argmax())], "probs": p} for p in outputs]
    return json_response({"results": outputs, "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens}})


def _check_pairs(request: Request, body: PredictRequest) -> None:
    for i, pair in enumerate(body.texts):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise APIError(422, f"texts[{i}]: must be a [query, document] pair on a rerank model",
                           "invalid_type", f"texts[{i}]")
        check_query(request, pair[0], f"texts[{i}][0]")
    prechecked(request, [p[1] for p in body.texts], "texts", True)


async def _predict_pairs(request: Request, body: PredictRequest) -> Response:
    """/predict on a reranker: ``{"texts": [[query, document], ...]}`` → ``{"results": [score, ...]}``."""
    pairs = [(q, d) for q, d in body.texts]
    result = await run_task(request, pairs, body, "texts", listed=True, task="rerank")
    if isinstance(result, Response):
        return result
    return json_response({"results": [float(o[0]) for o in result.outputs], "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens}})



def _usage(result: TaskResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}



def _check_classify(request: Request, body: ClassifyRequest) -> None:
    listed = isinstance(body.input, list)
    prechecked(request, body.input if listed else [body.input], "input", listed)


@router.post("/v1/classify", openapi_extra=request_body(ClassifyRequest),
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
