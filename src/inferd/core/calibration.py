"""The int8/uint8 calibration of one load: the vectors a request asking for quantized embeddings is scaled by
(core/quantize.py), measured on the load itself the first time a request asks, and kept on its slot.

Measured while the asking request holds the slot, so a request computed just before a switch still gets the
ranges of the model that computed it (not a 404 or a 503 for a version gone). The texts go through the queue
like any request's, by the admission step's own call (``RunTexts``), which charges no tenant: the calibration is
the load's, measured once for every caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from inferd.core import quantize
from inferd.core.outcomes import TaskResult
from inferd.core.registry import ServedModel
from inferd.core.slots import ModelSlot

# Texts through the queue on a slot, as one request of them, nobody's (admission's tokenise, enqueue and wait).
RunTexts = Callable[[ModelSlot, list[Any]], Awaitable[TaskResult]]


async def calibration(served: ServedModel, slot: ModelSlot, run: RunTexts) -> np.ndarray:
    """The calibration vectors of the load on ``slot``: measured once, by the first request that asks, and
    shared by every request that asks while it runs."""
    future = slot.calibration
    if future is None or (future.done() and (future.cancelled() or future.exception() is not None)):
        # A failed measure is tried again by the next request; its own error reaches the waiters.
        future = slot.calibration = asyncio.ensure_future(_measure(served, slot.acquire(), run))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return await asyncio.shield(future)


async def _measure(served: ServedModel, slot: ModelSlot, run: RunTexts) -> np.ndarray:
    """The calibration texts (``model.calibration_file``, else a built-in multilingual set) as they are (no
    prompt), through the queue on ``slot``, whose reference this task holds until it is done."""
    try:
        settings = served.settings
        limit = settings.limits.max_chars_per_text
        texts = [t[:limit] for t in quantize.calibration_texts(settings.model.calibration_file) if t.strip()]
        step = min(settings.limits.max_items_per_request, settings.batching.max_queue)
        out: list[Any] = []
        for start in range(0, len(texts), step):
            got = await run(slot, texts[start: start + step])
            out.extend(got.outputs)
        return np.vstack([np.asarray(v, dtype=np.float32) for v in out])
    finally:
        slot.release()
