"""A stream of messages, each its own engine request, answered in order while later ones already run.

One text per message (TEI's streaming RPCs): awaited one at a time, a stream would run batches of one. So up to
``window`` messages are in the engine at once (the scheduler batches them with everyone's work), and their answers
leave in the order the messages came. The window bounds what one stream holds of the queue; beyond it the reader
waits, and so does the client (HTTP/2 flow control): nothing is dropped.

A stream is pinned to the model load its first message ran on (``name@version``): its answers are of one model. A
stream still open when a hot reload retires that version is ended UNAVAILABLE saying so, to be reopened on the
version now served (its earlier answers stand); one open while the server drains is ended UNAVAILABLE (draining)
as its next message is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from inferd.api.errors import APIError
from inferd.core.errors import Kind
from inferd.core.outcomes import TaskResult
from inferd.grpc.call import Call
from inferd.grpc.status import Code, Refused

M = TypeVar("M")
R = TypeVar("R")

_END = object()
# The kinds a pinned version's end is refused with: the version is no longer served.
_GONE = frozenset({Kind.MODEL_NOT_FOUND, Kind.MODEL_UNLOADED})


class Pin:
    """The model load a stream runs on: none until its first answer, then that answer's ``name@version``."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.model: str | None = call.header("x-model") or None
        self.pinned: str | None = None

    def options(self) -> dict[str, Any]:
        return {"model": self.pinned} if self.pinned else {}

    def took(self, result: TaskResult) -> None:
        if self.pinned is None:
            self.pinned = f"{result.model}@{result.version}"

    def refusal(self, exc: APIError) -> Exception:
        """A pinned version gone is the stream's end, said as such; any other refusal as it is."""
        if self.pinned is not None and exc.kind in _GONE:
            return Refused(Code.UNAVAILABLE, f"this stream ran on {self.pinned}, which a model change has retired: "
                           "its answers so far stand; reopen the stream to continue on the version now served")
        return exc


async def ordered(call: Call, messages: AsyncIterator[M], answer: Callable[[M], Awaitable[R]],
                  window: int) -> AsyncIterator[R]:
    """``answer`` of each message, in the messages' order, up to ``window`` running or answered and not yet sent at
    once; the first runs alone (it pins the stream's model, Pin). The first refusal ends the stream with it.

    A place of the window is taken before a message's task starts and given back once its answer is sent: the
    queue's bound alone let a task start while the queue was full, and one more run while the first was awaited
    (``window`` + 2 in the engine), past a tenant's ``max_concurrent`` the window is held to (grpc/embed.py)."""
    queue: asyncio.Queue[Any] = asyncio.Queue(max(1, window))
    room = asyncio.Semaphore(max(1, window))

    async def read() -> None:
        try:
            first = True
            async for message in messages:
                await room.acquire()
                call.messages += 1
                task = asyncio.ensure_future(answer(message))
                await queue.put(task)
                if first:
                    first = False
                    await asyncio.wait([task])
        except Exception as exc:  # the client's stream broke: answered after what came before
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            await queue.put(failed)
        await queue.put(_END)

    reader = asyncio.ensure_future(read())
    try:
        while (item := await queue.get()) is not _END:
            answered = await item
            room.release()
            yield answered
    finally:
        reader.cancel()
        left = [reader]
        while not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, asyncio.Future):
                item.cancel()
                left.append(item)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*left, return_exceptions=True)


Answers = tuple[list[R], Exception | None]  # a group's answers in order, then the refusal that ends the stream


async def grouped(call: Call, messages: AsyncIterator[M], answer: Callable[[list[M]], Awaitable[Answers[R]]],
                  window: int, most: int) -> AsyncIterator[R]:
    """The answers of the messages, in order, from ``answer`` run on groups of them: the messages that arrived
    while the stream's previous groups were in the engine, at most ``most`` (one engine request: one tokenising
    pass, one ticket, instead of one per text). At most two groups run at once and ``window`` messages are held;
    at a low rate a group is one message, as ``ordered`` would run it. The first group runs alone (the pin)."""
    room = asyncio.Semaphore(max(1, window))
    running = asyncio.Semaphore(2)
    held: list[M] = []
    arrived = asyncio.Event()
    done: list[BaseException | None] = []  # set once the client's side ends (None) or breaks (the error)
    answers: asyncio.Queue[Any] = asyncio.Queue()

    async def read() -> None:
        try:
            async for message in messages:
                await room.acquire()
                call.messages += 1
                held.append(message)
                arrived.set()
        except Exception as exc:  # the client's stream broke: answered after what came before
            done.append(exc)
        else:
            done.append(None)
        arrived.set()

    async def send() -> None:
        first = True
        while True:
            await arrived.wait()
            if not held:
                failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                failed.set_result(([], done[0]))
                await answers.put(failed)
                await answers.put(_END)
                return
            await running.acquire()
            group, held[:] = held[:most], held[most:]
            if not held and not done:
                arrived.clear()
            task = asyncio.ensure_future(answer(group))
            task.add_done_callback(lambda _: running.release())
            await answers.put(task)
            if first:
                first = False
                await asyncio.wait([task])

    workers = [asyncio.ensure_future(read()), asyncio.ensure_future(send())]
    try:
        while (item := await answers.get()) is not _END:
            results, refusal = await item
            for result in results:
                room.release()
                yield result
            if refusal is not None:
                raise refusal
    finally:
        for worker in workers:
            worker.cancel()
        left: list[Any] = list(workers)
        while not answers.empty():
            item = answers.get_nowait()
            if isinstance(item, asyncio.Future):
                item.cancel()
                left.append(item)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*left, return_exceptions=True)
