"""Where a request's inputs are tokenised: a short request on the event loop (cheap, and overlapping the running
batch: the pipelining), a long one in the thread pool, so many requests at a time.

Admission tokenises a live request's inputs through it, and the shadow mirror (core/shadow_mirror.py) a mirrored
one's, shedding a long mirrored request rather than making live requests wait for the pool.
"""

from __future__ import annotations

import asyncio
from typing import Any

from inferd.core.preprocess import Encoded
from inferd.core.slots import ModelSlot
from inferd.core.text_options import InputOptions

# Below this many characters a request is tokenised on the event loop; above, in a thread.
INLINE_TOKENIZE_CHARS = 4096


def chars(item: Any) -> int:
    """The characters of one input: a text's, or both texts' of a (query, document) pair."""
    return len(item) if isinstance(item, str) else sum(map(len, item))


class Tokenizing:
    def __init__(self, concurrency: int) -> None:
        # Long texts are tokenised in the thread pool; this many requests at a time, the rest wait their turn
        # (so a few senders of huge texts cannot keep every request in preprocessing at once).
        self._threads = asyncio.Semaphore(concurrency)

    def would_wait(self, inputs: list[Any]) -> bool:
        """Whether ``inputs`` go to the thread pool and find every turn taken (live requests waiting)."""
        return sum(map(chars, inputs)) > INLINE_TOKENIZE_CHARS and self._threads.locked()

    async def encode(self, slot: ModelSlot, inputs: list[Any], options: InputOptions) -> list[Encoded]:
        """``inputs`` tokenised by the slot's handler as ``options`` say (Handler.preprocess_with)."""
        if sum(map(chars, inputs)) <= INLINE_TOKENIZE_CHARS:
            return slot.handler.preprocess_with(inputs, options)
        async with self._threads:
            return await asyncio.to_thread(slot.handler.preprocess_with, inputs, options)
