"""TEI's ``tei.v1.Tokenize`` (Tokenize, Decode and their streams) and ``tei.v1.Info`` services.

Tokenize and Decode hold the served model's untruncated tokenizer as TEI's HTTP /tokenize and /decode do
(api/tei_tokens.py ServedTokenizer: the tenant's allow-list and concurrency apply) and answer with the same rows
(``tokens``, ``id_lists``). Info is /info's TEI fields (api/catalog.py tei_info) of the default model the caller may
see, its ``model_type`` by the task object.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from inferd import __version__
from inferd.api.catalog import tei_info, visible
from inferd.api.errors import Names, engine_refusal
from inferd.api.services import services_of
from inferd.api.tei_tokens import ServedTokenizer, id_lists, tokens
from inferd.core.errors import EngineError
from inferd.core.prompts import Prompt, prompt_text
from inferd.core.tasks.kinds import CLASSIFICATION, EMBEDDING, RERANK, task_of
from inferd.core.tasks.task import Task
from inferd.grpc.call import Call, streaming, unary
from inferd.grpc.embed import optional, window
from inferd.grpc.streams import ordered
from inferd.grpc.stubs import pb, rpc

_TEXT = Names("inputs", False)
# Requests over this many characters are tokenised in a thread, as /tokenize's.
_INLINE_CHARS = 4096
# TEI's ModelType of each task's model (a plug-in's task shows as a reranker, as /info's model_type does).
MODEL_TYPES: dict[Task, int] = {EMBEDDING: pb.MODEL_TYPE_EMBEDDING, CLASSIFICATION: pb.MODEL_TYPE_CLASSIFIER,
                                RERANK: pb.MODEL_TYPE_RERANKER}


class TokenizeServicer(rpc.TokenizeServicer):
    def __init__(self, app: Any) -> None:
        self.app, self.s = app, services_of(app)

    async def _tokenize(self, call: Call, message: Any) -> Any:
        checked = call.build([message.inputs], _TEXT)  # the text's own rules (length, emptiness), as /tokenize
        async with ServedTokenizer(self.s) as (tok, description):
            try:
                prompt = prompt_text(description, Prompt(optional(message, "prompt_name")), {})
            except EngineError as exc:
                raise engine_refusal(exc, _TEXT) from None
            texts = [prompt + t for t in checked.inputs]
            limit = self.s.settings.limits.max_tokenize_tokens
            if sum(map(len, texts)) > _INLINE_CHARS:
                rows = await asyncio.to_thread(tokens, tok, texts, message.add_special_tokens, limit)
            else:
                rows = tokens(tok, texts, message.add_special_tokens, limit)
        return pb.EncodeResponse(tokens=[pb.SimpleToken(**r) for r in rows[0]])

    async def _decode(self, call: Call, message: Any) -> Any:
        async with ServedTokenizer(self.s) as (tok, _):
            lists, _ = id_lists(list(message.ids), tok.get_vocab_size(with_added_tokens=True),
                                self.s.settings.limits.max_items_per_request)
            texts = tok.decode_batch(lists, skip_special_tokens=message.skip_special_tokens)
        return pb.DecodeResponse(text=texts[0])

    @unary("/tei.v1.Tokenize/Tokenize")
    async def Tokenize(self, call: Call, message: Any) -> Any:  # noqa: N802 (the proto's names)
        return await self._tokenize(call, message)

    @streaming("/tei.v1.Tokenize/TokenizeStream")
    async def TokenizeStream(self, call: Call, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:  # noqa: N802
        async for answer in ordered(call, messages, lambda m: self._tokenize(call, m), window(self.s)):
            yield answer

    @unary("/tei.v1.Tokenize/Decode")
    async def Decode(self, call: Call, message: Any) -> Any:  # noqa: N802
        return await self._decode(call, message)

    @streaming("/tei.v1.Tokenize/DecodeStream")
    async def DecodeStream(self, call: Call, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:  # noqa: N802
        async for answer in ordered(call, messages, lambda m: self._decode(call, m), window(self.s)):
            yield answer


class InfoServicer(rpc.InfoServicer):
    def __init__(self, app: Any) -> None:
        self.app, self.s = app, services_of(app)

    @unary("/tei.v1.Info/Info")
    async def Info(self, call: Call, message: Any) -> Any:  # noqa: N802
        shown = visible(call.request)
        default = self.s.registry.first()
        served = default if default in shown else (shown[0] if shown else None)
        fields = tei_info(self.s, served)
        name = served.task if served is not None else None
        return pb.InfoResponse(
            version=__version__, sha=fields["sha"], docker_label=fields["docker_label"],
            model_id=fields["model_id"] or "", model_sha=fields["model_sha"], model_dtype=fields["model_dtype"] or "",
            model_type=MODEL_TYPES.get(task_of(name) if name else EMBEDDING, pb.MODEL_TYPE_RERANKER),
            max_concurrent_requests=fields["max_concurrent_requests"] or 0,
            max_input_length=fields["max_input_length"] or 0, max_batch_tokens=fields["max_batch_tokens"],
            max_batch_requests=fields["max_batch_requests"], max_client_batch_size=fields["max_client_batch_size"],
            tokenization_workers=fields["tokenization_workers"])
