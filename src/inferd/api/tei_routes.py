"""text-embeddings-inference's HTTP API (router/src/http/server.rs and types.rs of huggingface/text-embeddings-
inference): /embed, /similarity, /rerank, /tokenize, /decode, /predict in TEI's shape and POST / by the served
task, so the clients built on it (huggingface_hub's InferenceClient, llama-index's and LangChain's TEI
embeddings, tei-client) work unchanged.

Errors on every one of these routes are in TEI's shape, ``{"error": message, "error_type": kind}``: its clients
read ``error`` as a string (tei-client lists a model's prompts by parsing the message of an unknown prompt_name).
The statuses stay inferd's; ``error_type`` is TEI's name for the refusal's kind (api/errors.py: KINDS and
TEI_TYPES, the two tables from a kind). A refusal before the route runs (401 key, 413 body size) keeps the one
error shape.

A server of several models runs each route's task default, as TEI's API names no model (``/rerank`` takes
inferd's optional ``model``); TEI's ``/predict`` runs the classification default for texts and the rerank
default for ``[query, document]`` pairs.

``POST /predict`` is inferd's own route (``{"texts": [...]}``) and TEI's (``{"inputs": ...}``): a body with
``inputs`` and no ``texts`` is TEI's (routes.py asks ``is_tei_predict`` first).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response
from tokenizers import Tokenizer

from inferd.api import vectors
from inferd.api.bodies import json_response, read_body
from inferd.api.client_schemas import (
    TEIDecodeRequest,
    TEIEmbedRequest,
    TEIError,
    TEIPrediction,
    TEIPredictRequest,
    TEISimilarityRequest,
    TEIToken,
    TEITokenizeRequest,
    direction,
)
from inferd.api.errors import APIError, engine_refusal, excerpt, refusal, tei_type
from inferd.api.inference import INFERENCE_ERRORS, check_query, prechecked, run_task
from inferd.api.schemas import ErrorResponse, TEIRerankRequest, TEIRerankResult, request_body
from inferd.api.services import inference_auth, services
from inferd.core.admission import model_refusal, not_ready
from inferd.core.errors import EngineError, Kind
from inferd.core.manager import ModelNotReady
from inferd.core.preprocess import TextInput
from inferd.core.prompts import Prompt, prompt_text
from inferd.core.registry import ModelNotFound
from inferd.core.slots import ModelDescription

tei_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys, as api/routes.py

# Requests over this many characters are tokenised (for /tokenize) in a thread, as admission does.
_INLINE_CHARS = 4096
# Non-truncating tokenizer copies kept for /tokenize and /decode, one per model load.
_TOKENIZERS_KEPT = 4

# -- TEI's error shape ---------------------------------------------------------------------------------------


def tei_error(exc: APIError) -> Response:
    return Response(orjson.dumps({"error": exc.message, "error_type": tei_type(exc)}), status_code=exc.status,
                    headers=exc.headers, media_type="application/json")


def tei_errors(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A TEI route answers its refusals in TEI's shape."""

    @functools.wraps(route)
    async def answered(request: Request) -> Response:
        try:
            return await route(request)
        except APIError as exc:
            return tei_error(exc)

    return answered


def tei_responses(ok: dict[str, Any], *errors: int) -> dict[int | str, Any]:
    out: dict[int | str, Any] = {200: ok}
    for status in errors:
        if status in (401, 413):  # answered before the route: the one error shape
            out[status] = {"model": ErrorResponse, "description": "Refused before the route (key, body size)"}
        else:
            out[status] = {"model": TEIError, "description": "TEI's error shape"}
    return out


def _array(items: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "array",
                                                                                      "items": items}}}}


_VECTORS = _array({"type": "array", "items": {"type": "number"}}, "One vector per input")
_SCORES = _array({"type": "number"}, "The cosine similarity of source_sentence with each sentence")
_TOKENS = _array({"type": "array", "items": TEIToken.model_json_schema()}, "The tokens of each input")
_DECODED = _array({"type": "string"}, "The text of each id list")
_PREDICTIONS = {"description": "Labels by score, best first: a list for one input, a list of lists for a batch",
                "content": {"application/json": {"schema": {"type": "array", "items": {"anyOf": [
                    TEIPrediction.model_json_schema(),
                    {"type": "array", "items": TEIPrediction.model_json_schema()}]}}}}}
_ANY = {"description": "As /embed, /similarity, /predict or /rerank answer (the served model's task)",
        "content": {"application/json": {"schema": {}}}}
_RANKED = _array(TEIRerankResult.model_json_schema(), "Scored texts, best first")


# -- /embed, /similarity -----------------------------------------------------------------------------------


def _texts(request: Request, inputs: Any, field: str) -> tuple[list[Any], bool]:
    listed = isinstance(inputs, list)
    if listed and inputs and isinstance(inputs[0], int | list) and not isinstance(inputs[0], bool):
        raise refusal(Kind.INVALID_INPUT, f"{field}: token ids are not supported; send text", "unsupported_input",
                      field)
    texts = inputs if listed else [inputs]
    prechecked(request, texts, field, listed)
    return texts, listed


@tei_router.post("/embed", openapi_extra=request_body(TEIEmbedRequest),
                 responses=tei_responses(_VECTORS, *INFERENCE_ERRORS))
@tei_errors
async def embed(request: Request) -> Response:
    """TEI's embed: ``{"inputs": str | [str], "normalize"?, "truncate"?, "truncation_direction"?,
    "prompt_name"?, "dimensions"?}`` → one vector per input (a list of lists, one text or many)."""
    checked: list[tuple[list[Any], bool]] = []
    body = await read_body(request, TEIEmbedRequest, lambda b: checked.append(_texts(request, b.inputs, "inputs")))
    texts, listed = checked[0]
    inputs = vectors.inputs_of(texts, direction(body.truncation_direction), body.truncate)
    # The prompt and the normalisation are those of the model load that runs the texts (a canary's own).
    result = await run_task(request, inputs, body, "inputs", listed, task="embedding", dimensions=body.dimensions,
                            prompt=Prompt(body.prompt_name))
    if isinstance(result, Response):
        return result
    if not body.normalize and result.description.normalize:
        raise refusal(Kind.INVALID_INPUT, "normalize: false is not available on this model: its own configuration "
                      "normalises its vectors (a Normalize module, or model.normalize: true)", "invalid_value",
                      "normalize")
    return json_response(vectors.vectors_of(result, body.dimensions, body.normalize))


@tei_router.post("/similarity", openapi_extra=request_body(TEISimilarityRequest),
                 responses=tei_responses(_SCORES, *INFERENCE_ERRORS))
@tei_errors
async def similarity(request: Request) -> Response:
    """TEI's (and the Hugging Face sentence-similarity task's): ``{"inputs": {"source_sentence", "sentences"},
    "parameters"?: {"truncate", "truncation_direction", "prompt_name"}}`` → a cosine per sentence."""

    def check(b: TEISimilarityRequest) -> None:
        check_query(request, b.inputs.source_sentence, "inputs.source_sentence")
        # The source sentence is one of the request's texts: count the sentences against what is left, so the
        # refusal names the number the client sent (the engine would count both).
        most = services(request).settings.limits.max_items_per_request - 1
        if len(b.inputs.sentences) > most:
            raise refusal(Kind.INVALID_INPUT, f"inputs.sentences: {len(b.inputs.sentences)} sentences given; at "
                          f"most {most} per request: with inputs.source_sentence, {most + 1} texts "
                          "(limits.max_items_per_request)", "too_many_items", "inputs.sentences")
        prechecked(request, b.inputs.sentences, "inputs.sentences", True)

    body = await read_body(request, TEISimilarityRequest, check)
    params = body.parameters
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    inputs = vectors.inputs_of(texts, direction(params.truncation_direction) if params else "right",
                               params.truncate if params else None)
    prompt = Prompt(params.prompt_name if params else None, field="parameters.prompt_name")
    try:
        result = await run_task(request, inputs, body, "inputs", True, task="embedding", prompt=prompt)
    except APIError as exc:
        raise _similarity_param(exc) from None
    if isinstance(result, Response):
        return result
    v = vectors.quantize.unit(np.vstack([np.asarray(o, dtype=np.float32) for o in result.outputs]))
    return json_response([float(x) for x in v[1:].astype(np.float64) @ v[0].astype(np.float64)])


def _similarity_param(exc: APIError) -> APIError:
    """The engine names an input by its place among [source_sentence, *sentences]: name it by its field."""
    if exc.param and exc.param.startswith("inputs["):
        index = int(exc.param[len("inputs["): -1])
        param = "inputs.source_sentence" if index == 0 else f"inputs.sentences[{index - 1}]"
        exc.message = exc.message.replace(exc.param, param, 1)
        exc.param = param
    return exc


# -- /predict in TEI's shape -------------------------------------------------------------------------------


async def is_tei_predict(request: Request) -> bool:
    """A /predict body in TEI's shape: a JSON object with ``inputs`` and without ``texts`` (inferd's own)."""
    raw = await request.body()
    if b'"inputs"' not in raw:
        return False  # the common case, decided without parsing twice
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False  # inferd's route answers the malformed body
    return isinstance(data, dict) and "inputs" in data and "texts" not in data


def _sequences(inputs: Any) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's PredictInput: a text, a pair ``[a, b]`` (or ``[a]``), or a batch ``[[a], [a, b], ...]``.
    Returns the sequences and whether it was a batch."""
    def one(value: Any, where: str) -> str | tuple[str, str]:
        if isinstance(value, list) and len(value) in (1, 2) and all(isinstance(v, str) for v in value):
            return value[0] if len(value) == 1 else (value[0], value[1])
        raise refusal(Kind.INVALID_INPUT, f"{where}: must be [text] or [text, text]", "invalid_type", where)

    if isinstance(inputs, str):
        return [inputs], False
    if not isinstance(inputs, list) or not inputs:
        raise refusal(Kind.INVALID_INPUT, "inputs: must be a text, a pair of texts, or a batch of texts and pairs",
                      "invalid_type", "inputs")
    if isinstance(inputs[0], str):
        return [one(inputs, "inputs")], False
    return [one(v, f"inputs[{i}]") for i, v in enumerate(inputs)], True


def _predict_task(request: Request, sequences: list[Any]) -> str:
    """The task TEI's /predict runs for what was sent: texts are a classifier's, ``[query, document]`` pairs a
    reranker's (TEI serves one model and hands it either; here each goes to its task's default model)."""
    pairs = [not isinstance(s, str) for s in sequences]
    if any(pairs) and not all(pairs):
        raise refusal(Kind.INVALID_INPUT, "inputs: a batch is texts (for a classifier) or [query, document] pairs "
                      "(for a reranker), not both", "invalid_type", "inputs")
    task = "rerank" if pairs[0] else "classification"
    tasks = {m.task for m in services(request).registry}
    if task in tasks or None in tasks:
        return task
    if "classification" in tasks:
        raise refusal(Kind.INVALID_INPUT, "inputs: this server's classifier takes single texts, not pairs",
                      "invalid_type", "inputs")
    if "rerank" in tasks:
        raise refusal(Kind.INVALID_INPUT, "inputs: a rerank model scores [query, document] pairs, not single texts",
                      "invalid_type", "inputs")
    served = ", ".join(sorted(t for t in tasks if t)) or "no"
    raise refusal(Kind.WRONG_TASK, f"/predict with inputs serves classification and rerank models; this server "
                  f"serves {served} models (their routes: /embed, /v1/embeddings)")


@tei_errors
async def tei_predict(request: Request) -> Response:
    """TEI's predict: each input's labels by score, best first (a classifier's probabilities for texts, or a
    reranker's pair score under its ``LABEL_0``-style label for pairs)."""
    parsed: dict[str, Any] = {}

    def check(b: TEIPredictRequest) -> None:
        sequences, batch = _sequences(b.inputs)
        parsed.update(sequences=sequences, batch=batch)
        singles = [s for s in sequences if isinstance(s, str)]
        prechecked(request, singles or [p[1] for p in sequences], "inputs", batch)

    body = await read_body(request, TEIPredictRequest, check)
    sequences, batch = parsed["sequences"], parsed["batch"]
    if _predict_task(request, sequences) == "classification":
        rows = await _classify(request, body, sequences, batch)
    else:
        rows = await _score_pairs(request, body, sequences, batch)
    if isinstance(rows, Response):
        return rows
    params = body.parameters
    if params is not None and params.top_k is not None:
        rows = [r[: params.top_k] for r in rows]
    return json_response(rows if batch else rows[0])


def _applied(params: Any, own: str, raw: bool) -> str | None:
    """The field that asks for raw logits (raw_scores, or function_to_apply "none"), if one does; refuses
    another activation than the model's own."""
    wanted = params.function_to_apply if params is not None else None
    if wanted is not None and wanted != "none" and wanted != own:
        raise refusal(Kind.INVALID_INPUT, f"parameters.function_to_apply: this model applies {own}; {wanted} was "
                      "asked", "invalid_value", "parameters.function_to_apply")
    if raw:
        return "raw_scores"
    return "parameters.function_to_apply" if wanted == "none" else None


async def _classify(request: Request, body: TEIPredictRequest, sequences: list[Any], batch: bool
                    ) -> list[list[dict[str, Any]]] | Response:
    inputs = vectors.inputs_of(sequences, direction(body.truncation_direction), body.truncate)
    result = await run_task(request, inputs, body, "inputs", batch, task="classification")
    if isinstance(result, Response):
        return result
    # The activation is the answering model's (a canary's own): checked on its description, after the run.
    own = "sigmoid" if result.description.facts.get("multi_label") else "softmax"
    asked = _applied(body.parameters, own, body.raw_scores)
    if asked is not None:
        # The task computes probabilities only: a softmax's logits cannot be recovered from them.
        raise refusal(Kind.INVALID_INPUT, f"{asked}: asks for logits; a classifier answers probabilities here "
                      f"({own}: send function_to_apply {own} or leave it out)", "invalid_value", asked)
    labels = list(result.description.labels or ())
    return [sorted(({"score": float(p), "label": labels[i]} for i, p in enumerate(probs)),
                   key=lambda r: -r["score"]) for probs in result.outputs]


def _pairs(query: str, documents: list[str], truncate: bool | None, side: str) -> list[tuple[str, str]]:
    """The engine's (query, document) pairs: a document carries the request's truncation choices when it asks
    for any (core/preprocess.py PairEncoder: ``left`` cuts the document's start; the query is kept whole)."""
    cut = direction(side)
    if truncate is None and cut == "right":
        return [(query, d) for d in documents]
    return [(query, TextInput(d, direction=cut, truncate=truncate)) for d in documents]


async def _score_pairs(request: Request, body: TEIPredictRequest, sequences: list[Any], batch: bool
                       ) -> list[list[dict[str, Any]]] | Response:
    pairs = []
    for i, (query, document) in enumerate(sequences):
        check_query(request, query, f"inputs[{i}][0]" if batch else "inputs[0]")
        pairs.extend(_pairs(query, [document], body.truncate, body.truncation_direction))
    raw = _applied(body.parameters, "sigmoid", body.raw_scores) is not None
    result = await run_task(request, pairs, body, "inputs", batch, task="rerank")
    if isinstance(result, Response):
        return result
    label = (result.description.labels or ("LABEL_0",))[0]
    return [[{"score": float(o[1] if raw else o[0]), "label": label}] for o in result.outputs]


# -- /rerank -----------------------------------------------------------------------------------------------


@tei_router.post("/rerank", openapi_extra=request_body(TEIRerankRequest),
                 responses=tei_responses(_RANKED, *INFERENCE_ERRORS))
@tei_errors
async def rerank(request: Request) -> Response:
    """TEI's rerank: ``{"query", "texts", "raw_scores"?, "return_text"?, "truncate"?, "truncation_direction"?}``
    → each text's index and score, best first. Each (query, text) pair is one item for the engine."""
    # As the other task routes: a server without a reranker refuses the route itself before reading the body.
    try:
        services(request).registry.resolve(None, "rerank")
    except ModelNotFound as exc:
        raise engine_refusal(model_refusal(exc), "model", False) from None

    def check(b: TEIRerankRequest) -> None:
        check_query(request, b.query)
        prechecked(request, b.texts, "texts", True)  # each text is an item, named texts[i] when at fault

    body = await read_body(request, TEIRerankRequest, check)
    pairs = _pairs(body.query, body.texts, body.truncate, body.truncation_direction)
    result = await run_task(request, pairs, body, "texts", listed=True, task="rerank")
    if isinstance(result, Response):
        return result
    column = 1 if body.raw_scores else 0
    order = sorted(range(len(body.texts)), key=lambda i: -float(result.outputs[i][column]))
    out = []
    for i in order:
        item: dict[str, Any] = {"index": i, "score": float(result.outputs[i][column])}
        if body.return_text:
            item["text"] = body.texts[i]
        out.append(item)
    return json_response(out)


# -- /tokenize, /decode ------------------------------------------------------------------------------------


class _Tokenizer:
    """The served model's tokenizer, untruncated (TEI's /tokenize shows every token), with a slot reference
    held while it is used."""

    def __init__(self, request: Request) -> None:
        self.request = request

    async def __aenter__(self) -> tuple[Tokenizer, ModelDescription]:
        s = services(self.request)
        try:
            served, pin = s.registry.resolve(None, None)
            if served.settings.model.load_mode == "lazy":
                await served.manager.ensure_loaded()
            self.slot = served.manager.pick(None, pin)
        except ModelNotFound as exc:
            raise engine_refusal(model_refusal(exc), "model", False) from None
        except ModelNotReady as exc:
            raise engine_refusal(not_ready(exc), "model", False) from None
        try:
            return self._untruncated(), self.slot.description
        except BaseException:
            self.slot.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.slot.release()

    def _untruncated(self) -> Tokenizer:
        state = self.request.app.state
        kept: OrderedDict[Any, Tokenizer] | None = getattr(state, "inferd_tokenizers", None)
        if kept is None:
            kept = state.inferd_tokenizers = OrderedDict()
        tok = kept.get(self.slot.load_id)
        if tok is None:
            own = getattr(self.slot.handler, "tokenizer", None)
            if not isinstance(own, Tokenizer):
                raise refusal(Kind.WRONG_TASK, "this model has no tokenizer to show", "no_tokenizer")
            tok = Tokenizer.from_str(own.to_str())
            tok.no_truncation()
            tok.no_padding()
            kept[self.slot.load_id] = tok
            while len(kept) > _TOKENIZERS_KEPT:
                kept.popitem(last=False)
        return tok


def _tokens(tok: Tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[dict[str, Any]]]:
    out = []
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=add_special_tokens), strict=True):
        # TEI's offsets are bytes of the (prompted) input; the tokenizer's are characters.
        at = np.concatenate(([0], np.cumsum([len(c.encode("utf-8", "surrogatepass")) for c in text]))).tolist()
        row = []
        for tid, (start, stop), special, token in zip(enc.ids, enc.offsets, enc.special_tokens_mask, enc.tokens,
                                                      strict=True):
            if special:
                row.append({"id": tid, "text": token, "special": True, "start": None, "stop": None})
            else:
                row.append({"id": tid, "text": text[start:stop], "special": False, "start": at[start],
                            "stop": at[stop]})
        out.append(row)
    return out


@tei_router.post("/tokenize", openapi_extra=request_body(TEITokenizeRequest),
                 responses=tei_responses(_TOKENS, 400, 401, 404, 413, 422, 503))
@tei_errors
async def tokenize(request: Request) -> Response:
    """TEI's tokenize: ``{"inputs": str | [str], "add_special_tokens"?, "prompt_name"?}`` → each input's tokens
    (``{"id", "text", "special", "start", "stop"}``, offsets in bytes of the prompted input)."""
    checked: list[tuple[list[Any], bool]] = []
    body = await read_body(request, TEITokenizeRequest, lambda b: checked.append(_texts(request, b.inputs, "inputs")))
    async with _Tokenizer(request) as (tok, description):
        try:
            prompt = prompt_text(description, Prompt(body.prompt_name), {})
        except EngineError as exc:
            raise engine_refusal(exc, "inputs", False) from None
        texts = [prompt + t for t in checked[0][0]]
        if sum(map(len, texts)) > _INLINE_CHARS:
            rows = await asyncio.to_thread(_tokens, tok, texts, body.add_special_tokens)
        else:
            rows = _tokens(tok, texts, body.add_special_tokens)
    return json_response(rows)


def _as_sent(raw: bytes, batch: bool, i: int, j: int, value: Any) -> str:
    """A refused id as the client wrote it: orjson reads an integer beyond 64 bits as a float, whose digits are
    not the client's (2**64 + 1 became "1.8446744073709552e+"); the standard parser keeps them (refusals only)."""
    if isinstance(value, float):
        try:
            ids = json.loads(raw)["ids"]
            exact = ids[i][j] if batch else ids[j]
        except (ValueError, LookupError, TypeError, RecursionError):
            exact = value
        return excerpt(str(exact) if isinstance(exact, int) else repr(value))
    if isinstance(value, bool | int | str) or value is None:
        return excerpt(orjson.dumps(value).decode())
    return "a list" if isinstance(value, list) else "an object"  # never echoed: it may nest a thousand deep


def _id_lists(request: Request, ids: Any, vocab: int, raw: bytes) -> tuple[list[list[int]], bool]:
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    lists = ids if batch else [ids]
    limit = services(request).settings.limits.max_items_per_request
    if not isinstance(ids, list) or not ids:
        raise refusal(Kind.INVALID_INPUT, "ids: must be a non-empty list of token ids, or a list of such lists",
                      "empty_input", "ids")
    if len(lists) > limit:
        raise refusal(Kind.INVALID_INPUT, f"ids: {len(lists)} id lists given; at most {limit} per request",
                      "too_many_items", "ids")
    for i, row in enumerate(lists):
        where = f"ids[{i}]" if batch else "ids"
        if not isinstance(row, list) or not row:
            raise refusal(Kind.INVALID_INPUT, f"{where}: must be a non-empty list of token ids", "empty_input", where)
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
                raise refusal(Kind.INVALID_INPUT, f"{where}[{j}]: {_as_sent(raw, batch, i, j, v)} is not a token id "
                              f"of this model (0..{vocab - 1})", "invalid_value", f"{where}[{j}]")
    return lists, batch


@tei_router.post("/decode", openapi_extra=request_body(TEIDecodeRequest),
                 responses=tei_responses(_DECODED, 400, 401, 404, 413, 422, 503))
@tei_errors
async def decode(request: Request) -> Response:
    """TEI's decode: ``{"ids": [int] | [[int]], "skip_special_tokens"?}`` → the text of each id list."""
    body = await read_body(request, TEIDecodeRequest)
    async with _Tokenizer(request) as (tok, _):
        lists, _ = _id_lists(request, body.ids, tok.get_vocab_size(with_added_tokens=True), await request.body())
        texts = tok.decode_batch(lists, skip_special_tokens=body.skip_special_tokens)
    return json_response(texts)


# -- POST / ------------------------------------------------------------------------------------------------


@tei_router.post("/", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "anyOf": [TEIEmbedRequest.model_json_schema(), TEISimilarityRequest.model_json_schema(),
              TEIPredictRequest.model_json_schema(), TEIRerankRequest.model_json_schema()]}}}}},
    responses=tei_responses(_ANY, *INFERENCE_ERRORS))
@tei_errors
async def root(request: Request) -> Response:
    """TEI's POST /, by the served (default) model's task: embedding → /embed (or /similarity for a body whose
    ``inputs`` is ``{"source_sentence", "sentences"}``: huggingface_hub's sentence_similarity posts it here),
    classification → /predict, rerank → /rerank."""
    s = services(request)
    served = s.registry.first()
    task = (served.task if served is not None else None) or "embedding"
    if task == "classification":
        return await tei_predict(request)
    if task == "rerank":
        return await rerank(request)
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw.strip() else None
    except orjson.JSONDecodeError:
        data = None  # /embed answers the malformed body
    if isinstance(data, dict) and isinstance(data.get("inputs"), dict):
        return await similarity(request)
    return await embed(request)


# -- /info -------------------------------------------------------------------------------------------------


def tei_info(request: Request) -> dict[str, Any]:
    """The /info fields text-embeddings-inference's clients read (router/src/lib.rs Info; tei-client requires
    each key), for the default model: ``model_type`` is ``{"embedding": {"pooling"}}``, ``{"classifier":
    {"id2label", "label2id"}}`` or ``{"reranker": ...}``. TEI's own ``version`` (its router's) is not given:
    inferd's ``version`` is the model's."""
    s = services(request)
    served = s.registry.first()
    settings = served.settings if served is not None else s.settings
    slots = served.manager.slots() if served is not None else []
    d: dict[str, Any] = slots[0][1].info if slots else {}
    task = (served.task if served is not None else None) or d.get("task") or "embedding"
    if task == "embedding":
        model_type: dict[str, Any] = {"embedding": {"pooling": d.get("pooling") or settings.model.pooling or "mean"}}
    else:
        labels = d.get("labels") or ["LABEL_0"]
        model_type = {"classifier" if task == "classification" else "reranker": {
            "id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)}}}
    return {
        "model_id": d.get("name") or settings.model.name, "model_sha": None,
        "model_dtype": d.get("dtype") or settings.model.dtype, "served_model_name": served.name if served else None,
        "model_type": model_type, "max_concurrent_requests": settings.server.limit_concurrency,
        "max_input_length": d.get("max_seq_length"), "max_batch_tokens": settings.batching.max_batch_tokens,
        "max_batch_requests": settings.batching.max_batch_size,
        "max_client_batch_size": settings.limits.max_items_per_request, "auto_truncate": settings.model.truncate,
        "tokenization_workers": settings.limits.preprocess_concurrency, "sha": None, "docker_label": None}
