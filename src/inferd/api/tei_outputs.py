"""TEI's /embed_sparse and /embed_all (router/src/http/types.rs of huggingface/text-embeddings-inference:
``EmbedSparseRequest``, ``EmbedAllRequest``) in TEI's shapes and error shape: a model's sparse weights as
``[[{"index", "value"}]]`` and its token vectors as ``[[[float]]]``, always a list per input (one text or many).

TEI's /embed_all answers a model's last hidden states, every token included; here it answers the model's
multi-vector output (ColBERT's or bge-m3's token vectors: projected, normalised, special tokens left out), the
vectors a late-interaction index stores. A model without that output (or, on /embed_sparse, without sparse
weights) is refused with 422 naming what it gives.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api import hybrid
from inferd.api.bodies import json_response, read_body
from inferd.api.client_schemas import TEIEmbedAllRequest, TEIEmbedSparseRequest, direction
from inferd.api.inference import INFERENCE_ERRORS, run_task
from inferd.api.schemas import request_body
from inferd.api.services import inference_auth, services
from inferd.api.tei_shape import tei_errors, tei_responses, tei_texts
from inferd.core.prompts import Prompt

tei_outputs_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys

_SPARSE = {"description": "Each input's nonzero weights by vocabulary id", "content": {"application/json": {
    "schema": {"type": "array", "items": {"type": "array", "items": {
        "type": "object", "required": ["index", "value"],
        "properties": {"index": {"type": "integer"}, "value": {"type": "number"}}}}}}}}
_ALL = {"description": "Each input's token vectors", "content": {"application/json": {"schema": {
    "type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}}}}}


async def _outputs(request: Request, model: type[TEIEmbedSparseRequest], kind: str) -> Response:
    checked: list[tuple[list[Any], bool]] = []
    body = await read_body(request, model, lambda b: checked.append(tei_texts(request, b.inputs, "inputs")))
    texts, listed = checked[0]
    inputs = hybrid.asking(texts, (kind,), direction(body.truncation_direction), body.truncate)
    result = await run_task(request, inputs, body, "inputs", listed, task="embedding",
                            prompt=Prompt(body.prompt_name))
    if isinstance(result, Response):
        return result
    outputs = hybrid.outputs_of(result, (kind,), None)
    if kind == "sparse":
        return json_response([hybrid.sparse_pairs(o.sparse) for o in outputs if o.sparse is not None])
    hybrid.check_token_vectors(outputs, services(request).settings.limits.max_multivector_tokens)
    return json_response([o.multivector for o in outputs])


@tei_outputs_router.post("/embed_sparse", openapi_extra=request_body(TEIEmbedSparseRequest),
                         responses=tei_responses(_SPARSE, *INFERENCE_ERRORS))
@tei_errors
async def embed_sparse(request: Request) -> Response:
    """TEI's embed_sparse: ``{"inputs": str | [str], "truncate"?, "truncation_direction"?, "prompt_name"?}`` →
    each input's ``[{"index", "value"}]``, ids ascending (a SPLADE model's, or bge-m3's lexical weights)."""
    return await _outputs(request, TEIEmbedSparseRequest, "sparse")


@tei_outputs_router.post("/embed_all", openapi_extra=request_body(TEIEmbedAllRequest),
                         responses=tei_responses(_ALL, *INFERENCE_ERRORS))
@tei_errors
async def embed_all(request: Request) -> Response:
    """TEI's embed_all: the same body → each input's token vectors (a multi-vector model's: ColBERT's, bge-m3's),
    at most ``limits.max_multivector_tokens`` in one answer (422 naming it)."""
    return await _outputs(request, TEIEmbedAllRequest, "multivector")
