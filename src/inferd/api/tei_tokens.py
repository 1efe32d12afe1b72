"""TEI's /tokenize and /decode: the served model's tokenizer, untruncated, in TEI's shapes and error shape.

No model runs, yet both are a tenant's requests as any other (core/tenant.py ``Tenant.admit``): the model they
show must be on its allow-list, and they count towards its requests per second and concurrent requests. Their
tokens are not charged to its budget, which counts the tokens a model ran; what bounds /tokenize's answer instead is
``limits.max_tokenize_tokens``, checked on the token count before the answer is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response
from tokenizers import Tokenizer

from inferd.api.bodies import json_response, read_body
from inferd.api.client_schemas import (
    TEIDecodeRequest,
    TEITokenizeRequest,
)
from inferd.api.engine_call import build
from inferd.api.errors import Names, engine_refusal, refusal
from inferd.api.schemas import request_body
from inferd.api.services import Services, inference_auth, services
from inferd.api.tei_shape import DECODED, TOKENS, tei_errors, tei_inputs, tei_responses
from inferd.core.description import ModelDescription
from inferd.core.errors import EngineError, Kind, excerpt
from inferd.core.prompts import Prompt, prompt_text
from inferd.core.request import InferenceRequest
from inferd.core.tenants import current_tenant

tei_tokens_router = APIRouter(dependencies=[Depends(inference_auth)])  # the inference keys


# Requests over this many characters are tokenised (for /tokenize) in a thread, as admission does.
_INLINE_CHARS = 4096
# Non-truncating tokenizer copies kept for /tokenize and /decode, one per model load.
_TOKENIZERS_KEPT = 4


# -- /tokenize, /decode ------------------------------------------------------------------------------------


class ServedTokenizer:
    """The served model's tokenizer, untruncated (TEI's /tokenize shows every token), with a slot reference
    held while it is used (TEI's gRPC Tokenize and Decode hold it too: grpc/tokens.py)."""

    def __init__(self, s: Services) -> None:
        self.s = s

    async def __aenter__(self) -> tuple[Tokenizer, ModelDescription]:
        s = self.s
        tenant = current_tenant.get()
        try:
            served, _ = s.registry.resolve(None, None)  # the server's default model, as engine.hold() picks it
            if tenant is not None:
                tenant.admit(served.name, 0)  # its allow-list, rate and concurrency; left when this exits
        except EngineError as exc:
            raise engine_refusal(exc, Names("model"), s.metrics) from None
        # Let go in reverse: the slot, then the tenant's place.
        stack = contextlib.AsyncExitStack()
        if tenant is not None:
            stack.callback(tenant.leave)
        try:
            try:
                self.slot = await stack.enter_async_context(s.engine.hold(served.name))
            except EngineError as exc:
                raise engine_refusal(exc, Names("model")) from None
            tokenizer = self._untruncated()
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return tokenizer, self.slot.description

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def _untruncated(self) -> Tokenizer:
        kept = self.s.tokenizers
        tok = kept.get(self.slot.load_id)
        if tok is None:
            own = self.slot.loaded.tokenizer
            if own is None:
                raise refusal(Kind.WRONG_TASK, "this model has no tokenizer to show", "no_tokenizer")
            tok = Tokenizer.from_str(own.to_str())
            tok.no_truncation()
            tok.no_padding()
            kept[self.slot.load_id] = tok
            while len(kept) > _TOKENIZERS_KEPT:
                kept.popitem(last=False)
        return tok


def tokens(tok: Tokenizer, texts: list[str], add_special_tokens: bool, limit: int) -> list[list[dict[str, Any]]]:
    """Each text's tokens; over ``limit`` in all (limits.max_tokenize_tokens), refused before the answer is built."""
    encoded = tok.encode_batch(texts, add_special_tokens=add_special_tokens)
    count = sum(len(enc.ids) for enc in encoded)
    if count > limit:
        raise refusal(Kind.TOO_LONG, f"inputs: these texts hold {count} tokens; at most {limit} per /tokenize "
                      "answer (limits.max_tokenize_tokens): send fewer or shorter texts", "too_many_tokens",
                      "inputs")
    out = []
    for text, enc in zip(texts, encoded, strict=True):
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


@tei_tokens_router.post("/tokenize", openapi_extra=request_body(TEITokenizeRequest),
                 responses=tei_responses(TOKENS, 400, 401, 404, 413, 422, 503))
@tei_errors
async def tokenize(request: Request) -> Response:
    """TEI's tokenize: ``{"inputs": str | [str], "add_special_tokens"?, "prompt_name"?}`` → each input's tokens
    (``{"id", "text", "special", "start", "stop"}``, offsets in bytes of the prompted input)."""
    checked: list[InferenceRequest] = []
    body = await read_body(request, TEITokenizeRequest, lambda b: checked.append(
        build(request, tei_inputs(b.inputs, "inputs"), Names("inputs", isinstance(b.inputs, list)))))
    async with ServedTokenizer(services(request)) as (tok, description):
        try:
            prompt = prompt_text(description, Prompt(body.prompt_name), {})
        except EngineError as exc:
            raise engine_refusal(exc, Names("inputs")) from None
        texts = [prompt + t for t in checked[0].inputs]
        limit = services(request).settings.limits.max_tokenize_tokens
        if sum(map(len, texts)) > _INLINE_CHARS:
            rows = await asyncio.to_thread(tokens, tok, texts, body.add_special_tokens, limit)
        else:
            rows = tokens(tok, texts, body.add_special_tokens, limit)
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


def id_lists(ids: Any, vocab: int, limit: int, raw: bytes = b"") -> tuple[list[list[int]], bool]:
    """The id lists of /decode's ``ids`` (one list or a batch, at most ``limit``), each id checked against the
    vocabulary (``raw``: the body, to quote a refused id as it was sent)."""
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    lists = ids if batch else [ids]
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


@tei_tokens_router.post("/decode", openapi_extra=request_body(TEIDecodeRequest),
                 responses=tei_responses(DECODED, 400, 401, 404, 413, 422, 503))
@tei_errors
async def decode(request: Request) -> Response:
    """TEI's decode: ``{"ids": [int] | [[int]], "skip_special_tokens"?}`` → the text of each id list."""
    body = await read_body(request, TEIDecodeRequest)
    s = services(request)
    async with ServedTokenizer(s) as (tok, _):
        lists, _ = id_lists(body.ids, tok.get_vocab_size(with_added_tokens=True),
                            s.settings.limits.max_items_per_request,
                            await request.body())
        texts = tok.decode_batch(lists, skip_special_tokens=body.skip_special_tokens)
    return json_response(texts)

