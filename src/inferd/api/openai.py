"""OpenAI's embeddings: ``POST /v1/embeddings`` as the official ``openai`` client sends it (``/v1/models`` is
api/catalog.py's)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api import vectors
from inferd.api.bodies import json_response, read_body
from inferd.api.errors import APIError
from inferd.api.inference import (
    INFERENCE_ERRORS,
    prechecked,
    require_task,
    run_task,
    served_name,
)
from inferd.api.schemas import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    request_body,
    responses,
)
from inferd.api.services import inference_auth
from inferd.core.prompts import Prompt

openai_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys


@openai_router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingsRequest),
             responses=responses(EmbeddingsResponse, *INFERENCE_ERRORS))
async def embeddings(request: Request) -> Response:
    """OpenAI-compatible embeddings (the official ``openai`` client works against it)."""
    require_task(request, "embedding")
    body = await read_body(request, EmbeddingsRequest, lambda b: _check_input(request, b))
    listed = isinstance(body.input, list)
    texts = body.input if listed else [body.input]
    # The default prompt of the model that runs it (as sentence-transformers' encode), and a Matryoshka size cut
    # here by that model's normalisation.
    result = await run_task(request, texts, body, "input", listed, task="embedding", dimensions=body.dimensions,
                            prompt=Prompt())
    if isinstance(result, Response):
        return result
    outputs = result.outputs if body.dimensions is None else vectors.vectors_of(result, body.dimensions)
    if body.encoding_format == "base64":
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")}
                for i, v in enumerate(outputs)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(outputs)]
    return json_response({"object": "list", "data": data, "model": served_name(result),
                          "usage": {"prompt_tokens": result.prompt_tokens,
                                    "total_tokens": result.prompt_tokens}})


def _check_input(request: Request, body: EmbeddingsRequest) -> None:
    listed = isinstance(body.input, list)
    # OpenAI also accepts token ids (a list of ints, or a list of such lists); this service takes text only.
    # The first item decides, in constant time: a long list of numbers must not be walked on the event loop.
    if listed and body.input and isinstance(body.input[0], int | list) and not isinstance(body.input[0], bool):
        raise APIError(422, "input: token arrays are not supported; send text", "unsupported_input", "input")
    prechecked(request, body.input if listed else [body.input], "input", listed)

