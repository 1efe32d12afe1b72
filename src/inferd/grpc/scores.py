"""TEI's ``tei.v1.Predict`` and ``tei.v1.Rerank`` services over the classification and rerank models.

Predict takes one text (the classifier's); PredictPair a ``[text]`` or ``[query, document]`` (the reranker's pair,
as TEI's HTTP /predict sends a pair to the rerank default here); Rerank a query and its texts, RerankStream one
(query, text) per message, ranked when the client closes its side (one engine request: at most
``limits.max_items_per_request`` texts, as Rerank). Each is the engine request its HTTP route makes (api/tei.py
/rerank, api/tei_predict.py /predict) and is shaped by the same code (tei_predict.classified and scored,
tei_shape.tei_ranks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from inferd.api import vectors
from inferd.api.client_schemas import TEIPredictRequest
from inferd.api.errors import APIError, Names
from inferd.api.services import services_of
from inferd.api.tei_predict import classified, scored
from inferd.api.tei_shape import tei_pairs, tei_ranks
from inferd.core.outcomes import TaskResult
from inferd.core.tasks.kinds import CLASSIFICATION, RERANK
from inferd.core.text_options import InputOptions, TextOptions
from inferd.grpc.call import Call, streaming, unary
from inferd.grpc.embed import direction, metadata, window
from inferd.grpc.status import Code, Refused
from inferd.grpc.streams import Pin, ordered
from inferd.grpc.stubs import pb, rpc

_TEXT = Names("inputs", False)
_PAIR = Names("inputs", False, query="inputs[0]")
_RERANK = Names("texts")


class PredictServicer(rpc.PredictServicer):
    def __init__(self, app: Any) -> None:
        self.app, self.s = app, services_of(app)

    async def _predict(self, call: Call, message: Any, sequence: list[str], pin: Pin | None = None) -> Any:
        side = direction(message.truncation_direction)
        if len(sequence) == 2:
            inputs: list[Any] = tei_pairs(sequence[0], [sequence[1]])
            task, names = RERANK, _PAIR
        else:
            inputs, task, names = list(sequence), CLASSIFICATION, _TEXT
        options: dict[str, Any] = {"task": task.name, "text_options": vectors.options_of(side, message.truncate),
                                   **(pin.options() if pin is not None else {})}
        try:
            result = await call.ask_engine(call.build(inputs, names, **options), names)
        except APIError as exc:
            raise (pin.refusal(exc) if pin is not None else exc) from None
        if pin is not None:
            pin.took(result)
        body = TEIPredictRequest(inputs=sequence, raw_scores=message.raw_scores)
        rows = scored(body, result) if task.takes_pairs else classified(body, result)
        return pb.PredictResponse(predictions=[pb.Prediction(**r) for r in rows[0]],
                                  metadata=metadata(result, sum(map(len, sequence))))

    async def _text(self, call: Call, message: Any, pin: Pin | None = None) -> Any:
        return await self._predict(call, message, [message.inputs], pin)

    async def _pair(self, call: Call, message: Any, pin: Pin | None = None) -> Any:
        if len(message.inputs) not in (1, 2):
            raise Refused(Code.INVALID_ARGUMENT, f"inputs: must be [text] or [text, text], not {len(message.inputs)} "
                          "texts")
        return await self._predict(call, message, list(message.inputs), pin)

    @unary("/tei.v1.Predict/Predict")
    async def Predict(self, call: Call, message: Any) -> Any:  # noqa: N802 (the proto's names)
        return await self._text(call, message)

    @unary("/tei.v1.Predict/PredictPair")
    async def PredictPair(self, call: Call, message: Any) -> Any:  # noqa: N802
        return await self._pair(call, message)

    @streaming("/tei.v1.Predict/PredictStream")
    async def PredictStream(self, call: Call, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:  # noqa: N802
        pin = Pin(call)
        async for answer in ordered(call, messages, lambda m: self._text(call, m, pin), window(self.s)):
            yield answer

    @streaming("/tei.v1.Predict/PredictPairStream")
    async def PredictPairStream(self, call: Call, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:  # noqa: N802
        pin = Pin(call)
        async for answer in ordered(call, messages, lambda m: self._pair(call, m, pin), window(self.s)):
            yield answer


class RerankServicer(rpc.RerankServicer):
    def __init__(self, app: Any) -> None:
        self.app, self.s = app, services_of(app)

    async def _rank(self, call: Call, query: str, texts: list[str], first: Any, pairs: list[tuple[str, Any]],
                    cuts: InputOptions) -> Any:
        request = call.build(pairs, _RERANK, task=RERANK.name, text_options=cuts)
        result: TaskResult = await call.ask_engine(request, _RERANK)
        ranks = [pb.Rank(index=i, score=score, text=texts[i] if first.return_text else None)
                 for i, score in tei_ranks(result, first.raw_scores)]
        return pb.RerankResponse(ranks=ranks, metadata=metadata(result, len(query) + sum(map(len, texts))))

    @unary("/tei.v1.Rerank/Rerank")
    async def Rerank(self, call: Call, message: Any) -> Any:  # noqa: N802
        texts = list(message.texts)
        pairs = tei_pairs(message.query, texts)
        cuts = vectors.options_of(direction(message.truncation_direction), message.truncate)
        return await self._rank(call, message.query, texts, message, pairs, cuts)

    @unary("/tei.v1.Rerank/RerankStream")
    async def RerankStream(self, call: Call, messages: AsyncIterator[Any]) -> Any:  # noqa: N802
        first: Any = None
        texts: list[str] = []
        pairs: list[tuple[str, Any]] = []
        cuts: list[TextOptions] = []  # each message chooses its own cut
        limit = self.s.settings.limits.max_items_per_request
        async for message in messages:
            call.messages += 1
            if call.messages > limit:  # refused as it arrives: the texts are held until the client closes its side
                raise Refused(Code.INVALID_ARGUMENT, f"texts: more than {limit} texts given; at most {limit} per "
                              "request (one per message)")
            first = first or message  # raw_scores and return_text: the first message's (TEI's rule)
            texts.append(message.text)
            pairs += tei_pairs(message.query, [message.text])
            cuts.append(TextOptions(direction=direction(message.truncation_direction), truncate=message.truncate))
        if first is None:
            raise Refused(Code.INVALID_ARGUMENT, "texts: the stream sent no (query, text) message")
        return await self._rank(call, first.query, texts, first, pairs, InputOptions.of(cuts))
