"""inferd's own inference routes: the seed's ``/predict`` (each task's natural result; a body in TEI's shape is
TEI's /predict, api/tei_predict.py) and ``/v1/classify`` (vLLM's shape: a label and each label's probability)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api.answers import ClassifyResponse, PredictResponse, responses
from inferd.api.bodies import json_response
from inferd.api.engine_call import (
    INFERENCE_ERRORS,
    ask_engine,
    build,
    model_task,
    read_request,
    require_task,
    served_name,
)
from inferd.api.errors import APIError, Names
from inferd.api.middleware import context
from inferd.api.rerank_chunking import chunking_of
from inferd.api.schemas import ClassifyRequest, PredictRequest, request_body
from inferd.api.services import inference_auth
from inferd.api.tei_predict import is_tei_predict, tei_predict
from inferd.core.long_rerank import span_of
from inferd.core.outcomes import TaskResult
from inferd.core.request import InferenceRequest
from inferd.core.tasks.kinds import CLASSIFICATION, task_of
from inferd.core.tasks.task import Task

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
    body, engine_request = await read_request(request, PredictRequest, lambda b: _predict_request(request, b))
    result = await ask_engine(request, engine_request, _PREDICT)
    extra: dict[str, Any] = {}
    if engine_request.pairs:
        outputs = [float(o[0]) for o in result.outputs]  # each pair's score ([score, raw] rows)
        if body.chunking is not None:  # each pair's span that scored (null: its document was not split)
            extra["spans"] = [span_of(o) for o in result.outputs]
    else:
        # By the task of the load that answered (a model's task may be known only once it has loaded).
        outputs = _TEXT_RESULTS.get(task_of(result.description.task), _as_computed)(result)
    return json_response({"results": outputs, **extra, "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens}})


# A reranker's texts are [query, document] pairs: a query is named by its place in its pair.
_PREDICT = Names("texts", query="texts[{i}][0]")


def _labelled(result: TaskResult) -> list[Any]:
    labels = list(result.description.labels or ())
    return [{"label": labels[int(p.argmax())], "probs": p} for p in result.outputs]


def _as_computed(result: TaskResult) -> list[Any]:
    return result.outputs


# /predict's result for texts of a model of each task (keyed by the task object): a classifier's label and
# probabilities; any other task's (an embedding's vectors, a plug-in's own) as the model computed it.
_TEXT_RESULTS: dict[Task, Callable[[TaskResult], list[Any]]] = {CLASSIFICATION: _labelled}


def _predict_request(request: Request, body: PredictRequest) -> InferenceRequest:
    """The named model's (or the default model's) task sets the shape: a reranker's texts are pairs."""
    task = model_task(request, body.model)
    texts: list[Any] = body.texts
    if task.takes_pairs:
        for i, pair in enumerate(texts):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise APIError(422, f"texts[{i}]: must be a [query, document] pair on a rerank model",
                               "invalid_type", f"texts[{i}]")
        texts = [(q, d) for q, d in texts]
    return build(request, texts, _PREDICT, task=task.name, model=body.model, priority=body.priority,
                 timeout_ms=body.timeout_ms, chunking=chunking_of(body.chunking))


def _usage(result: TaskResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}



def _classify_names(body: ClassifyRequest) -> Names:
    return Names("input", isinstance(body.input, list))


def _classify_request(request: Request, body: ClassifyRequest) -> InferenceRequest:
    texts = body.input if isinstance(body.input, list) else [body.input]
    return build(request, texts, _classify_names(body), task="classification", model=body.model,
                 priority=body.priority, timeout_ms=body.timeout_ms)


@router.post("/v1/classify", openapi_extra=request_body(ClassifyRequest),
                  responses=responses(ClassifyResponse, *INFERENCE_ERRORS))
async def classify(request: Request) -> Response:
    """vLLM's classify: ``{"input": str | [str]}`` → a label and the probability of each label per text."""
    require_task(request, "classification")
    body, engine_request = await read_request(request, ClassifyRequest, lambda b: _classify_request(request, b))
    result = await ask_engine(request, engine_request, _classify_names(body))
    labels = list(result.description.labels or ())
    data = [{"index": i, "label": labels[int(p.argmax())], "probs": [float(x) for x in p],
             "num_classes": len(labels), "object": "classification"} for i, p in enumerate(result.outputs)]
    return json_response({"id": context(request.scope)["request_id"], "object": "list", "data": data,
                          "model": served_name(result), "usage": _usage(result)})
