"""Messages that are not what their method takes answer INVALID_ARGUMENT, naming the message type.

grpcio parses a request before the servicer runs and answers a bytes string that does not parse with UNKNOWN
("Unexpected DecodeError") and a traceback in the log. This interceptor takes the parsing over: each method's
handler receives bytes and parses them itself, so a malformed unary request is refused INVALID_ARGUMENT, and a
malformed message in a stream ends that stream with it, after the answers to the messages before it (the servicer
sees the refusal as it reads, and counts and logs it as any other: grpc/call.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from inferd.grpc.status import Code, Refused

Parse = Callable[[bytes], Any]


def _parsed(parse: Parse, raw: bytes) -> Any:
    try:
        return parse(raw)
    except (DecodeError, ValueError) as exc:
        name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        what = f"a {name.full_name}" if name is not None else "the method's message"
        raise Refused(Code.INVALID_ARGUMENT, f"the request is not {what}: {exc}") from None


async def _each(parse: Parse, messages: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    async for raw in messages:
        yield _parsed(parse, raw)


def _one(parse: Parse, behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
         ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            message = _parsed(parse, raw)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        return await behaviour(message, context)
    return handle


class ParseMessages(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.stream_stream is not None:
            both = handler.stream_stream

            async def streamed(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
                async for answer in both(_each(parse, messages), context):
                    yield answer
            return handler._replace(request_deserializer=None, stream_stream=streamed)
        if handler.stream_unary is not None:
            many = handler.stream_unary

            async def gathered(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
                return await many(_each(parse, messages), context)
            return handler._replace(request_deserializer=None, stream_unary=gathered)
        if handler.unary_stream is not None:
            return handler  # no such method in tei.v1: grpcio's own parsing stands
        return handler._replace(request_deserializer=None, unary_unary=_one(parse, handler.unary_unary))
