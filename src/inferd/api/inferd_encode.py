"""inferd's ``POST /v1/encode``: any of an embedding model's outputs for each text, from one forward pass.

``outputs`` names them: ``dense`` (the pooled vector), ``sparse`` (``{indices, values}``: vocabulary ids
ascending and their weights, the shape Qdrant's ``SparseVector`` and Milvus' sparse rows take; ``return_tokens``
adds each id's token text) and ``multivector`` (one vector per kept token: ColBERT's, bge-m3's). bge-m3 gives all
three from one pass; a SPLADE model sparse only; any embedding model dense. The dense vector and each token vector
take ``encoding_format`` (float, base64 of float32, binary/ubinary sign bits); sparse weights are floats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd.api import documents, hybrid, vectors
from inferd.api.answers import EncodeResponse, responses
from inferd.api.bodies import json_response
from inferd.api.engine_call import INFERENCE_ERRORS, ask_engine, build, read_request, served_name
from inferd.api.errors import Names
from inferd.api.schemas import EncodeRequest, request_body
from inferd.api.services import inference_auth, services
from inferd.core.outputs import TextOutputs
from inferd.core.prompts import Prompt
from inferd.core.request import InferenceRequest
from inferd.core.tasks.kinds import DENSE, MULTIVECTOR, SPARSE
from inferd.core.tasks.task import Output
from inferd.core.text_options import InputOptions, TextOptions

encode_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys


def _names(body: EncodeRequest) -> Names:
    return Names("input", isinstance(body.input, list))


def _request(request: Request, body: EncodeRequest) -> InferenceRequest:
    texts = body.input if isinstance(body.input, list) else [body.input]
    if body.input_type == "query":  # a late-interaction model's query encoding (its marker and expansion)
        options = InputOptions(TextOptions(direction=body.truncation_direction, truncate=body.truncate, role="query"))
    else:
        options = vectors.options_of(body.truncation_direction, body.truncate)
    return build(request, texts, _names(body),
                 task="embedding", model=body.model, priority=body.priority, timeout_ms=body.timeout_ms,
                 prompt=Prompt(body.prompt_name), outputs=tuple(body.outputs),
                 chunking=documents.chunking_of(body.chunking), text_options=options)


def _rows(value: Any, body: EncodeRequest) -> Any:
    return hybrid.encoded(value, body.encoding_format)


def _weights(value: Any, body: EncodeRequest) -> Any:
    return hybrid.sparse_object(value, body.return_tokens)


# How each output (keyed by its object) is written in an item, in the order an item lists them; an item's field is
# the output's name, as TextOutputs' is.
_WRITTEN: dict[Output, Callable[[Any, EncodeRequest], Any]] = {DENSE: _rows, SPARSE: _weights, MULTIVECTOR: _rows}


def _item(i: int, out: TextOutputs, body: EncodeRequest) -> dict[str, Any]:
    return {"object": "encoding", "index": i, **_piece(out, body)}


def _piece(out: TextOutputs, body: EncodeRequest) -> dict[str, Any]:
    """The outputs asked of one text (or piece of a document), each under its name."""
    item: dict[str, Any] = {}
    for output, write in _WRITTEN.items():
        value = getattr(out, output.name)
        if value is not None and output.name in body.outputs:
            item[output.name] = write(value, body)
    return item


@encode_router.post("/v1/encode", openapi_extra=request_body(EncodeRequest),
                    responses=responses(EncodeResponse, *INFERENCE_ERRORS))
async def encode(request: Request) -> Response:
    """``{"input": str | [str], "outputs": ["dense", "sparse", "multivector"], ...}`` → each text's outputs asked,
    ``{"object": "list", "data": [{"index", "dense"?, "sparse"?, "multivector"?}], "model", "usage"}``."""
    body, engine_request = await read_request(request, EncodeRequest, lambda b: _request(request, b))
    await documents.check_body_size(request, body.chunking)
    result = await ask_engine(request, engine_request, _names(body))
    pooled, pieces = documents.taken_apart(result)
    outputs = hybrid.outputs_of(pooled, body.outputs)
    # Pieces' outputs are answered too (mode pieces): the response's bounds hold over all of them.
    every = outputs + [o for r in pieces or () for o in hybrid.outputs_of(r, body.outputs)]
    limits = services(request).settings.limits
    hybrid.check_token_vectors(every, limits.max_multivector_tokens, "input")
    hybrid.check_sparse_weights(every, limits.max_sparse_weights, "input")
    tokens = result.prompt_tokens
    data = [_item(i, o, body) for i, o in enumerate(outputs)]
    for i, item in enumerate(data if pieces is not None else ()):
        shaped = [_piece(o, body) for o in hybrid.outputs_of(pieces[i], body.outputs)]  # type: ignore[index]
        item["pieces"] = [{**span, **fields} for span, fields in zip(documents.spans(result, i), shaped, strict=True)]
    return json_response({"object": "list", "data": data,
                          "model": served_name(result), "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
