"""Where a request's inputs are tokenised: a short request on the event loop (cheap, and overlapping the running
batch: the pipelining), a long one in the thread pool, so many requests at a time.

Admission tokenises a live request's inputs through it, and the shadow mirror (core/shadow_mirror.py) a mirrored
one's, shedding a long mirrored request rather than making live requests wait for the pool.

A batch job's lines (background requests) are tokenised together instead, off the loop: the short ones that arrive
in one turn of the loop, for one model load and the same options, in one call in a thread. A job hands the engine a
line as each one ends, and a batch of them ends at once: tokenised one at a time on the loop, 32 lines were a burst
every live request arriving meanwhile waited behind (a fifth of the loop's time in a job went to tokenising): the
loop's share of a live request's P99, 4 ms alone, was 10-12.5 ms beside a job, and is 6.4-7.8 ms so (bench/RESULTS.md,
"A job's lines tokenised together").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from inferd.core.preprocess import Encoded
from inferd.core.slots import ModelSlot
from inferd.core.text_options import InputOptions

# Below this many characters a request is tokenised on the event loop; above, in a thread.
INLINE_TOKENIZE_CHARS = 4096


def chars(item: Any) -> int:
    """The characters of one input: a text's, or both texts' of a (query, document) pair."""
    return len(item) if isinstance(item, str) else sum(map(len, item))


@dataclass
class _Group:
    """Background requests to tokenise in one call: each one's inputs and the future of its encodings."""

    slot: ModelSlot
    options: InputOptions
    waiting: list[tuple[list[Any], asyncio.Future[list[Encoded]]]] = field(default_factory=list)


class Tokenizing:
    def __init__(self, concurrency: int) -> None:
        # Long texts are tokenised in the thread pool; this many requests at a time, the rest wait their turn
        # (so a few senders of huge texts cannot keep every request in preprocessing at once).
        self._threads = asyncio.Semaphore(concurrency)
        # Background requests gathering for one call, by model load and options; the calls under way (the loop
        # keeps only a weak reference to a task).
        self._groups: dict[tuple[int, InputOptions], _Group] = {}
        self._calls: set[asyncio.Task[None]] = set()

    def would_wait(self, inputs: list[Any]) -> bool:
        """Whether ``inputs`` go to the thread pool and find every turn taken (live requests waiting)."""
        return sum(map(chars, inputs)) > INLINE_TOKENIZE_CHARS and self._threads.locked()

    async def encode(self, slot: ModelSlot, inputs: list[Any], options: InputOptions,
                     background: bool = False) -> list[Encoded]:
        """``inputs`` tokenised by the slot's handler as ``options`` say (Handler.preprocess_with); ``background``:
        a batch job's request, tokenised together with others of the same turn of the loop, in a thread."""
        if sum(map(chars, inputs)) <= INLINE_TOKENIZE_CHARS:
            if background and options.each is None:
                return await self._together(slot, inputs, options)
            return slot.handler.preprocess_with(inputs, options)
        async with self._threads:
            return await asyncio.to_thread(slot.handler.preprocess_with, inputs, options)

    async def _together(self, slot: ModelSlot, inputs: list[Any], options: InputOptions) -> list[Encoded]:
        loop = asyncio.get_running_loop()
        key = (id(slot), options)  # the slot is held by its requests until they are answered
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(slot, options)
            call = loop.create_task(self._call(key))  # its first step runs after this turn's other callbacks
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
        done: asyncio.Future[list[Encoded]] = loop.create_future()
        group.waiting.append((inputs, done))
        return await done

    async def _call(self, key: tuple[int, InputOptions]) -> None:
        """One group's requests in one call in a thread; where that call refuses an input, each request in a call
        of its own, so one line's refusal is that line's alone."""
        group = self._groups.pop(key)
        handler, options = group.slot.handler, group.options
        try:
            encoded = await asyncio.to_thread(handler.preprocess_with,
                                              [x for inputs, _ in group.waiting for x in inputs], options)
        except Exception:
            for inputs, done in group.waiting:
                try:
                    result = await asyncio.to_thread(handler.preprocess_with, inputs, options)
                except Exception as exc:
                    if not done.done():
                        done.set_exception(exc)
                else:
                    if not done.done():
                        done.set_result(result)
            return
        except BaseException:  # cancelled (the loop shuts down): none of its requests waits for ever
            for _, done in group.waiting:
                done.cancel()
            raise
        at = 0
        for inputs, done in group.waiting:
            if not done.done():  # a request cancelled meanwhile has gone
                done.set_result(encoded[at:at + len(inputs)])
            at += len(inputs)
