"""TEI's ``tei.v1.Embed`` service: Embed, EmbedSparse and EmbedAll (one text per message), each with its streaming
form, on the embedding models. Each message is the request TEI's HTTP route makes of one text (api/tei.py /embed,
api/tei_outputs.py /embed_sparse and /embed_all, the last hidden state of every token): the same engine request,
the same shaping (tei_shape.tei_vectors, hybrid's sparse pairs and caps), so an answer equals the HTTP route's for
that text."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from inferd.api import hybrid, vectors
from inferd.api.errors import APIError, Names
from inferd.api.services import Services, services_of
from inferd.api.tei_shape import tei_vectors
from inferd.core.outcomes import TaskResult
from inferd.core.prompts import Prompt
from inferd.core.tasks.kinds import EMBEDDING, SPARSE, TOKEN_STATES
from inferd.core.tasks.task import Output
from inferd.core.tenants import current_tenant
from inferd.grpc.call import Call, streaming, unary
from inferd.grpc.status import Refused
from inferd.grpc.streams import Answers, Pin, grouped, ordered
from inferd.grpc.stubs import pb, rpc

# One text per message: a refusal names the field itself.
NAMES = Names("inputs", False, fields={"outputs": "model"})
_DIRECTIONS = {pb.TRUNCATION_DIRECTION_RIGHT: "right", pb.TRUNCATION_DIRECTION_LEFT: "left"}


def direction(value: int) -> Any:
    """TEI's TruncationDirection (an unknown number is the default, right, as proto3 reads an unknown enum)."""
    return _DIRECTIONS.get(value, "right")


def optional(message: Any, field: str) -> Any:
    return getattr(message, field) if message.HasField(field) else None


def metadata(result: TaskResult, chars: int, tokens: int | None = None) -> Any:
    """TEI's Metadata of one answer: its characters and tokens (``tokens``: of one text of the result), and its
    stages' times (ns)."""
    t = result.timings
    ns = {k: int(t.get(k, 0.0) * 1e6) for k in ("preprocess_ms", "queue_ms", "inference_ms", "postprocess_ms")}
    return pb.Metadata(compute_chars=chars, compute_tokens=result.prompt_tokens if tokens is None else tokens,
                       total_time_ns=sum(ns.values()),
                       tokenization_time_ns=ns["preprocess_ms"], queue_time_ns=ns["queue_ms"],
                       inference_time_ns=ns["inference_ms"])


def window(s: Services) -> int:
    """Messages of one stream in the engine at once: two of the largest batch, so a stream alone keeps the
    scheduler's next batch full while one runs; at most its tenant's ``max_concurrent``. Each message is a request
    of the tenant's, and the read-ahead is the server's doing, not the client's: beyond that limit it refused the
    stream's own messages, ending the stream RESOURCE_EXHAUSTED however slowly the client sent them."""
    ahead = 2 * s.settings.batching.max_batch_size
    tenant = current_tenant.get()  # the RPC's, set by its key check (grpc/call.py) before the handler runs
    limit = None if tenant is None else tenant.rules.max_concurrent
    return ahead if limit is None else max(1, min(ahead, limit))


def _alike(a: Any, b: Any) -> bool:
    """Two EmbedRequests that ask the same of their texts (truncation, prompt, size, normalisation)."""
    return (a.truncate == b.truncate and a.truncation_direction == b.truncation_direction
            and optional(a, "prompt_name") == optional(b, "prompt_name")
            and optional(a, "dimensions") == optional(b, "dimensions")
            and optional(a, "normalize") == optional(b, "normalize"))


class EmbedServicer(rpc.EmbedServicer):
    def __init__(self, app: Any) -> None:
        self.app, self.s = app, services_of(app)

    async def _embed(self, call: Call, message: Any, pin: Pin | None, output: Output | None = None,
                   texts: list[str] | None = None) -> TaskResult:
        """One engine request of ``message``'s text (or of ``texts``, sent with the options of ``message``)."""
        names = NAMES if texts is None else Names("inputs", fields={"outputs": "model"})
        texts = texts or [message.inputs]
        options: dict[str, Any] = {"task": EMBEDDING.name, "prompt": Prompt(optional(message, "prompt_name")),
                                   "text_options": vectors.options_of(direction(message.truncation_direction),
                                                                      message.truncate)}
        if output is not None:
            options["outputs"] = (output.name,)
        else:
            options["dimensions"] = optional(message, "dimensions")
        if pin is not None:
            options.update(pin.options())
        try:
            result = await call.ask_engine(call.build(texts, names, **options), names)
        except APIError as exc:
            raise (pin.refusal(exc) if pin is not None else exc) from None
        if pin is not None:
            pin.took(result)
        return result

    async def _dense(self, call: Call, message: Any, pin: Pin | None = None) -> Any:
        result = await self._embed(call, message, pin)
        normalize = message.normalize if message.HasField("normalize") else True  # TEI's default
        v = tei_vectors(result, optional(message, "dimensions"), normalize)[0]
        return pb.EmbedResponse(embeddings=v.tolist(), metadata=metadata(result, len(message.inputs)))

    async def _sparse(self, call: Call, message: Any, pin: Pin | None = None) -> Any:
        result = await self._embed(call, message, pin, SPARSE)
        outputs = hybrid.outputs_of(result, (SPARSE.name,))
        hybrid.check_sparse_weights(outputs, self.s.settings.limits.max_sparse_weights)
        pairs = hybrid.sparse_pairs(outputs[0].sparse) if outputs[0].sparse is not None else []
        return pb.EmbedSparseResponse(sparse_embeddings=[pb.SparseValue(**p) for p in pairs],
                                      metadata=metadata(result, len(message.inputs)))

    async def _all(self, call: Call, message: Any, pin: Pin | None = None) -> Any:
        result = await self._embed(call, message, pin, TOKEN_STATES)
        outputs = hybrid.outputs_of(result, (TOKEN_STATES.name,))
        hybrid.check_token_vectors(outputs, self.s.settings.limits.max_multivector_tokens)
        rows = np.asarray(outputs[0].token_states, dtype=np.float32).tolist()
        return pb.EmbedAllResponse(token_embeddings=[pb.TokenEmbedding(embeddings=r) for r in rows],
                                   metadata=metadata(result, len(message.inputs)))

    def _stream(self, call: Call, messages: AsyncIterator[Any], one: Callable[..., Any]) -> AsyncIterator[Any]:
        pin = Pin(call)
        return ordered(call, messages, lambda m: one(call, m, pin), window(self.s))

    @unary("/tei.v1.Embed/Embed")
    async def Embed(self, call: Call, message: Any) -> Any:  # noqa: N802 (the proto's names)
        return await self._dense(call, message)

    async def _dense_group(self, call: Call, group: list[Any], pin: Pin) -> Answers[Any]:
        """The messages' vectors from one engine request when they ask alike (everything but the text), else, or
        when that request is refused, message by message: the refusal then ends the stream at its own message."""
        first = group[0]
        if len(group) > 1 and all(_alike(m, first) for m in group[1:]):
            try:
                result = await self._embed(call, first, pin, texts=[m.inputs for m in group])
                normalize = first.normalize if first.HasField("normalize") else True
                rows = tei_vectors(result, optional(first, "dimensions"), normalize)
                return [pb.EmbedResponse(embeddings=v.tolist(), metadata=metadata(result, len(m.inputs), n))
                        for m, v, n in zip(group, rows, result.tokens, strict=True)], None
            except (APIError, Refused):
                pass  # found again below, at its own message
        answers: list[Any] = []
        for message in group:
            try:
                answers.append(await self._dense(call, message, pin))
            except (APIError, Refused) as exc:
                return answers, exc
        return answers, None

    @streaming("/tei.v1.Embed/EmbedStream")
    async def EmbedStream(self, call: Call, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:  # noqa: N802
        # Messages that arrive together run as one engine request (streams.grouped): TEI's one text per message
        # costs a request per text otherwise.
        pin = Pin(call)
        async for answer in grouped(call, messages, lambda g: self._dense_group(call, g, pin), window(self.s),
                                    self.s.settings.batching.max_batch_size):
            yield answer

    @unary("/tei.v1.Embed/EmbedSparse")
    async def EmbedSparse(self, call: Call, message: Any) -> Any:  # noqa: N802
        return await self._sparse(call, message)

    @streaming("/tei.v1.Embed/EmbedSparseStream")
    async def EmbedSparseStream(self, call: Call, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:  # noqa: N802
        async for answer in self._stream(call, messages, self._sparse):
            yield answer

    @unary("/tei.v1.Embed/EmbedAll")
    async def EmbedAll(self, call: Call, message: Any) -> Any:  # noqa: N802
        return await self._all(call, message)

    @streaming("/tei.v1.Embed/EmbedAllStream")
    async def EmbedAllStream(self, call: Call, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:  # noqa: N802
        async for answer in self._stream(call, messages, self._all):
            yield answer
