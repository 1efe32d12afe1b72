"""OpenAI's embeddings: ``POST /v1/embeddings`` as the official ``openai`` client sends it (``/v1/models`` is
api/catalog.py's)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api import documents, vectors
from inferd.api.answers import EmbeddingsResponse, responses
from inferd.api.bodies import json_response
from inferd.api.engine_call import INFERENCE_ERRORS, ask_engine, build, read_request, require_task, served_name
from inferd.api.errors import APIError, Names
from inferd.api.schemas import EmbeddingsRequest, request_body
from inferd.api.services import inference_auth
from inferd.core.outcomes import TaskResult
from inferd.core.prompts import Prompt
from inferd.core.request import InferenceRequest

openai_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys


@openai_router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingsRequest),
             responses=responses(EmbeddingsResponse, *INFERENCE_ERRORS))
async def embeddings(request: Request) -> Response:
    """OpenAI-compatible embeddings (the official ``openai`` client works against it)."""
    require_task(request, "embedding")
    body, engine_request = await read_request(request, EmbeddingsRequest, lambda b: _request(request, b))
    await documents.check_body_size(request, body.chunking)
    result = await ask_engine(request, engine_request, _names(body))
    pooled, pieces = documents.taken_apart(result)
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(_embeddings(pooled, body))]
    if pieces is not None:  # chunking's mode "pieces": each document's pieces beside its pooled vector
        for i, item in enumerate(data):
            item["pieces"] = documents.with_spans(result, i, _embeddings(pieces[i], body), "embedding")
    return json_response({"object": "list", "data": data, "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens,
                                    "total_tokens": result.prompt_tokens}})


def _embeddings(result: TaskResult, body: EmbeddingsRequest) -> list[Any]:
    outputs = result.outputs if body.dimensions is None else vectors.vectors_of(result, body.dimensions)
    if body.encoding_format == "base64":
        return [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii") for v in outputs]
    return list(outputs)


def _names(body: EmbeddingsRequest) -> Names:
    return Names("input", isinstance(body.input, list))


def _request(request: Request, body: EmbeddingsRequest) -> InferenceRequest:
    listed = isinstance(body.input, list)
    # OpenAI also accepts token ids (a list of ints, or a list of such lists); this service takes text only.
    # The first item decides, in constant time: a long list of numbers must not be walked on the event loop.
    if listed and body.input and isinstance(body.input[0], int | list) and not isinstance(body.input[0], bool):
        raise APIError(422, "input: token arrays are not supported; send text", "unsupported_input", "input")
    # The default prompt of the model that runs it (as sentence-transformers' encode), and a Matryoshka size cut
    # here by that model's normalisation.
    return build(request, body.input if listed else [body.input], _names(body), task="embedding", model=body.model,
                 priority=body.priority, timeout_ms=body.timeout_ms, dimensions=body.dimensions, prompt=Prompt(),
                 chunking=documents.chunking_of(body.chunking))
