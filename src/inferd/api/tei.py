"""text-embeddings-inference's HTTP API (router/src/http/server.rs and types.rs of huggingface/text-embeddings-
inference) in TEI's shapes, so the clients built on it (huggingface_hub's InferenceClient, llama-index's and
LangChain's TEI embeddings, tei-client) work unchanged: this module holds /embed, /similarity, /rerank and POST /
(by the served task); api/tei_tokens.py /tokenize and /decode; api/tei_predict.py /predict; api/catalog.py the
fields of /info TEI's clients read. What they share (the error shape, the inputs) is api/tei_shape.py's.

Errors on every one of these routes are in TEI's shape, ``{"error": message, "error_type": kind}``: its clients
read ``error`` as a string (tei-client lists a model's prompts by parsing the message of an unknown prompt_name).
The statuses stay inferd's; ``error_type`` is TEI's name for the refusal's kind (api/errors.py: KINDS and
TEI_TYPES, the two tables from a kind). A refusal before the route runs (401 key, 413 body size) keeps the one
error shape.

A server of several models runs each route's task default, as TEI's API names no model (``/rerank`` takes
inferd's optional ``model``); TEI's ``/predict`` runs the classification default for texts and the rerank
default for ``[query, document]`` pairs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api import documents, vectors
from inferd.api.bodies import json_response
from inferd.api.client_schemas import (
    TEIEmbedRequest,
    TEIPredictRequest,
    TEISimilarityRequest,
    direction,
)
from inferd.api.engine_call import INFERENCE_ERRORS, ask_engine, build, read_request, require_task
from inferd.api.errors import APIError, Names, refusal
from inferd.api.rerank_chunking import chunking_of, with_span
from inferd.api.schemas import TEIRerankRequest, request_body
from inferd.api.services import inference_auth, services
from inferd.api.tei_predict import tei_predict
from inferd.api.tei_shape import (
    ANY,
    RANKED,
    SCORES,
    VECTORS,
    tei_errors,
    tei_inputs,
    tei_pairs,
    tei_ranks,
    tei_responses,
    tei_vectors,
)
from inferd.core.errors import Kind
from inferd.core.prompts import Prompt
from inferd.core.request import InferenceRequest
from inferd.core.tasks.kinds import CLASSIFICATION, RERANK, task_of
from inferd.core.tasks.task import Task

tei_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys


# -- /embed, /similarity -----------------------------------------------------------------------------------


def _embed_names(body: TEIEmbedRequest) -> Names:
    return Names("inputs", isinstance(body.inputs, list))


def _embed_request(request: Request, body: TEIEmbedRequest) -> InferenceRequest:
    texts = tei_inputs(body.inputs, "inputs")
    # The prompt and the normalisation are those of the model load that runs the texts (a canary's own).
    return build(request, texts, _embed_names(body), task="embedding", priority=body.priority,
                 timeout_ms=body.timeout_ms, dimensions=body.dimensions, prompt=Prompt(body.prompt_name),
                 chunking=documents.chunking_of(body.chunking),
                 text_options=vectors.options_of(direction(body.truncation_direction), body.truncate))


@tei_router.post("/embed", openapi_extra=request_body(TEIEmbedRequest),
                 responses=tei_responses(VECTORS, *INFERENCE_ERRORS))
@tei_errors
async def embed(request: Request) -> Response:
    """TEI's embed: ``{"inputs": str | [str], "normalize"?, "truncate"?, "truncation_direction"?,
    "prompt_name"?, "dimensions"?, "chunking"?}`` → one vector per input (a list of lists, one text or many); with
    chunking's mode "pieces", each input's pieces instead: ``[[{"start", "end", "tokens", "embedding"}]]``."""
    body, engine_request = await read_request(request, TEIEmbedRequest, lambda b: _embed_request(request, b))
    await documents.check_body_size(request, body.chunking)
    result = await ask_engine(request, engine_request, _embed_names(body))
    pooled, pieces = documents.taken_apart(result)
    if pieces is None:
        return json_response(tei_vectors(pooled, body.dimensions, body.normalize))
    return json_response([documents.with_spans(result, i, list(tei_vectors(r, body.dimensions, body.normalize)),
                                               "embedding") for i, r in enumerate(pieces)])


@tei_router.post("/similarity", openapi_extra=request_body(TEISimilarityRequest),
                 responses=tei_responses(SCORES, *INFERENCE_ERRORS))
@tei_errors
async def similarity(request: Request) -> Response:
    """TEI's (and the Hugging Face sentence-similarity task's): ``{"inputs": {"source_sentence", "sentences"},
    "parameters"?: {"truncate", "truncation_direction", "prompt_name"}}`` → a cosine per sentence."""

    try:
        _, engine_request = await read_request(request, TEISimilarityRequest,
                                               lambda b: _similarity_request(request, b))
        result = await ask_engine(request, engine_request, _SIMILARITY)
    except APIError as exc:
        raise _similarity_param(exc) from None
    v = vectors.quantize.unit(np.vstack([np.asarray(o, dtype=np.float32) for o in result.outputs]))
    return json_response([float(x) for x in v[1:].astype(np.float64) @ v[0].astype(np.float64)])


# The source sentence and the sentences are one list of texts for the engine (their cosines are of one model).
_SIMILARITY = Names("inputs")


def _similarity_request(request: Request, body: TEISimilarityRequest) -> InferenceRequest:
    params, sentences = body.parameters, body.inputs.sentences
    if not sentences:
        # One text would pass the request's count: the source sentence is compared with at least one other.
        raise refusal(Kind.INVALID_INPUT, "inputs.sentences: at least one text is required", "empty_input",
                      "inputs.sentences")
    texts = [body.inputs.source_sentence, *sentences]
    options = vectors.options_of(direction(params.truncation_direction) if params else "right",
                                 params.truncate if params else None)
    prompt = Prompt(params.prompt_name if params else None, field="parameters.prompt_name")
    try:
        return build(request, texts, _SIMILARITY, task="embedding", priority=body.priority,
                     timeout_ms=body.timeout_ms, prompt=prompt, text_options=options)
    except APIError as exc:
        most = services(request).settings.limits.max_items_per_request - 1
        if exc.code == "too_many_items" and len(sentences) > most:
            # Named by the number the client sent: the source sentence is one of the request's texts.
            exc.message = (f"inputs.sentences: {len(sentences)} sentences given; at most {most} per request: with "
                           f"inputs.source_sentence, {most + 1} texts (limits.max_items_per_request)")
            exc.param = "inputs.sentences"
        raise


def _similarity_param(exc: APIError) -> APIError:
    """The engine names an input by its place among [source_sentence, *sentences]: name it by its field."""
    if exc.param and exc.param.startswith("inputs["):
        index = int(exc.param[len("inputs["): -1])
        param = "inputs.source_sentence" if index == 0 else f"inputs.sentences[{index - 1}]"
        exc.message = exc.message.replace(exc.param, param, 1)
        exc.param = param
    return exc


# -- /rerank -----------------------------------------------------------------------------------------------


_RERANK = Names("texts")  # each text is an item, named texts[i] when at fault


def _rerank_request(request: Request, body: TEIRerankRequest) -> InferenceRequest:
    pairs = tei_pairs(body.query, body.texts)
    return build(request, pairs, _RERANK, task="rerank", model=body.model, priority=body.priority,
                 timeout_ms=body.timeout_ms, chunking=chunking_of(body.chunking),
                 text_options=vectors.options_of(direction(body.truncation_direction), body.truncate))


@tei_router.post("/rerank", openapi_extra=request_body(TEIRerankRequest),
                 responses=tei_responses(RANKED, *INFERENCE_ERRORS))
@tei_errors
async def rerank(request: Request) -> Response:
    """TEI's rerank: ``{"query", "texts", "raw_scores"?, "return_text"?, "truncate"?, "truncation_direction"?,
    "chunking"?}`` → each text's index and score, best first (and, for a text scored piece by piece, the ``span``
    that scored). Each (query, text) pair is one item for the engine."""
    # As the other task routes: a server without a reranker refuses the route itself before reading the body.
    require_task(request, "rerank")
    body, engine_request = await read_request(request, TEIRerankRequest, lambda b: _rerank_request(request, b))
    await documents.check_body_size(request, body.chunking)
    result = await ask_engine(request, engine_request, _RERANK)
    out = []
    for i, score in tei_ranks(result, body.raw_scores):
        item: dict[str, Any] = {"index": i, "score": score}
        if body.return_text:
            item["text"] = body.texts[i]
        out.append(with_span(item, result.outputs[i]))
    return json_response(out)



# -- POST / ------------------------------------------------------------------------------------------------


# The route POST / is for a model of each task (keyed by the task object); any other (an embedding model, a
# plug-in's task, a task not known until the model loads) is answered as /embed or /similarity.
_ROOT: dict[Task, Callable[[Request], Awaitable[Response]]] = {CLASSIFICATION: tei_predict, RERANK: rerank}


@tei_router.post("/", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "anyOf": [TEIEmbedRequest.model_json_schema(), TEISimilarityRequest.model_json_schema(),
              TEIPredictRequest.model_json_schema(), TEIRerankRequest.model_json_schema()]}}}}},
    responses=tei_responses(ANY, *INFERENCE_ERRORS))
@tei_errors
async def root(request: Request) -> Response:
    """TEI's POST /, by the served (default) model's task: embedding → /embed (or /similarity for a body whose
    ``inputs`` is ``{"source_sentence", "sentences"}``: huggingface_hub's sentence_similarity posts it here),
    classification → /predict, rerank → /rerank."""
    served = services(request).registry.first()
    route = _ROOT.get(task_of(served.task)) if served is not None and served.task else None
    if route is not None:
        return await route(request)
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw.strip() else None
    except orjson.JSONDecodeError:
        data = None  # /embed answers the malformed body
    if isinstance(data, dict) and isinstance(data.get("inputs"), dict):
        return await similarity(request)
    return await embed(request)

