"""TEI's /embed_sparse and /embed_all (router/src/http/types.rs of huggingface/text-embeddings-inference:
``EmbedSparseRequest``, ``EmbedAllRequest``) in TEI's shapes and error shape: a model's sparse weights as
``[[{"index", "value"}]]`` and its token vectors as ``[[[float]]]``, always a list per input (one text or many).

TEI's /embed_all answers a model's last hidden states, every token included (its raw embeddings); so does this
one, on any embedder whose forward pass hands over hidden states (core/tasks/token_states.py: a BERT, ModernBERT or
decoder embedder, bge-m3), unnormalised, special tokens and a prompt included. A model without them (a ColBERT
graph keeps only its projection: its token vectors are /v1/encode's ``multivector``; a SPLADE head) or, on
/embed_sparse, without sparse weights, is refused with 422 naming what it gives.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api import hybrid, vectors
from inferd.api.bodies import json_response
from inferd.api.client_schemas import TEIEmbedAllRequest, TEIEmbedSparseRequest, direction
from inferd.api.engine_call import INFERENCE_ERRORS, ask_engine, build, read_request
from inferd.api.errors import Names
from inferd.api.schemas import request_body
from inferd.api.services import inference_auth, services
from inferd.api.tei_shape import tei_errors, tei_inputs, tei_responses
from inferd.core.outputs import TextOutputs
from inferd.core.prompts import Prompt
from inferd.core.request import InferenceRequest
from inferd.core.tasks.kinds import SPARSE, TOKEN_STATES
from inferd.core.tasks.task import Output
from inferd.settings import LimitSettings

tei_outputs_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys

_SPARSE = {"description": "Each input's nonzero weights by vocabulary id", "content": {"application/json": {
    "schema": {"type": "array", "items": {"type": "array", "items": {
        "type": "object", "required": ["index", "value"],
        "properties": {"index": {"type": "integer"}, "value": {"type": "number"}}}}}}}}
_ALL = {"description": "Each input's last hidden state of every token", "content": {"application/json": {"schema": {
    "type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}}}}}


def _names(body: TEIEmbedSparseRequest) -> Names:
    # TEI names no outputs: a model that lacks the route's is the fault of the model the request ran on.
    return Names("inputs", isinstance(body.inputs, list), fields={"outputs": "model"})


def _request(request: Request, body: TEIEmbedSparseRequest, output: Output) -> InferenceRequest:
    texts = tei_inputs(body.inputs, "inputs")
    return build(request, texts, _names(body), task="embedding", model=body.model, priority=body.priority,
                 timeout_ms=body.timeout_ms, prompt=Prompt(body.prompt_name), outputs=(output.name,),
                 text_options=vectors.options_of(direction(body.truncation_direction), body.truncate))


def _sparse_weights(outputs: list[TextOutputs], limits: LimitSettings) -> Response:
    hybrid.check_sparse_weights(outputs, limits.max_sparse_weights)
    return json_response([hybrid.sparse_pairs(o.sparse) for o in outputs if o.sparse is not None])


def _token_states(outputs: list[TextOutputs], limits: LimitSettings) -> Response:
    hybrid.check_token_vectors(outputs, limits.max_multivector_tokens)
    return json_response([o.token_states for o in outputs])


# TEI's answer of each output its routes give (keyed by the output object), within its limit.
_ANSWERS: dict[Output, Callable[[list[TextOutputs], LimitSettings], Response]] = {
    SPARSE: _sparse_weights, TOKEN_STATES: _token_states}


async def _outputs(request: Request, schema: type[TEIEmbedSparseRequest], output: Output) -> Response:
    body, engine_request = await read_request(request, schema, lambda b: _request(request, b, output))
    outputs = hybrid.outputs_of(await ask_engine(request, engine_request, _names(body)), (output.name,))
    return _ANSWERS[output](outputs, services(request).settings.limits)


@tei_outputs_router.post("/embed_sparse", openapi_extra=request_body(TEIEmbedSparseRequest),
                         responses=tei_responses(_SPARSE, *INFERENCE_ERRORS))
@tei_errors
async def embed_sparse(request: Request) -> Response:
    """TEI's embed_sparse: ``{"inputs": str | [str], "truncate"?, "truncation_direction"?, "prompt_name"?}`` →
    each input's ``[{"index", "value"}]``, ids ascending (a SPLADE model's, or bge-m3's lexical weights), at most
    ``limits.max_sparse_weights`` in one answer (422 naming it)."""
    return await _outputs(request, TEIEmbedSparseRequest, SPARSE)


@tei_outputs_router.post("/embed_all", openapi_extra=request_body(TEIEmbedAllRequest),
                         responses=tei_responses(_ALL, *INFERENCE_ERRORS))
@tei_errors
async def embed_all(request: Request) -> Response:
    """TEI's embed_all: the same body → each input's last hidden state of every token (special tokens included),
    at most ``limits.max_multivector_tokens`` token vectors in one answer (422 naming it)."""
    return await _outputs(request, TEIEmbedAllRequest, TOKEN_STATES)
