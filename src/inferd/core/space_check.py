"""The canary's vector-space check: whether a candidate embedding model's vectors can share an index with the
active model's, measured by running both on the gate's built-in texts.

It runs inference, so on the worker thread (handlers are not shared across threads): between two batches, as
calls posted to the worker's thread, each a small batch of one model's (``SPACE_BATCH`` texts: live batches run
between them, as beside shadow work), while the caller (a model change, off the event loop) waits up to
``SPACE_TIMEOUT_S`` for each. A different size, or any text's cosine below ``model.gate.int8_cosine_min``, is
another space: the loosest bound the accuracy gate accepts (int8's), so quantisation noise stays above it and
another model's vectors (cosine near 0) fall far below; the half-precision bound would refuse an int8 canary
its own gate passed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from inferd.core.agreement import cosine_rows
from inferd.core.backends.gate_inputs import builtin_texts
from inferd.core.errors import ModelLoadError
from inferd.core.slots import ModelSlot, PostToWorker
from inferd.core.tasks.kinds import task_of

log = logging.getLogger(__name__)

# How many of the gate's built-in texts, and how long the check may wait for the worker.
SPACE_TEXTS = 64
SPACE_TIMEOUT_S = 120.0
# Texts of one posted call: a live request waits for one such batch at most. The whole check in one call (64 texts
# through both models) held live requests 1.7 s behind a canary's POST (a probe, MiniLM on the CPU).
SPACE_BATCH = 8


def space_changed(candidate: ModelSlot, active: ModelSlot, bound: float,
                  post_to_worker: PostToWorker | None) -> str | None:
    """Why an embedding ``candidate``'s vectors are not ``active``'s space (None: they are, or the models are
    not both embedders, or a plug-in handler cannot embed the built-in texts)."""
    if not (task_of(candidate.task).stored_vectors and task_of(active.task).stored_vectors):
        return None
    texts = builtin_texts(SPACE_TEXTS)
    active.acquire()
    try:
        a, b = _vectors(active, texts, post_to_worker), _vectors(candidate, texts, post_to_worker)
    except ModelLoadError as exc:
        log.warning("the canary's space check could not run: %s", exc, extra={"version": candidate.version})
        return None
    finally:
        active.release()
    low = float(cosine_rows(a, b).min()) if a.shape == b.shape else None
    if low is not None and low >= bound:
        return None
    what = (f"its vectors have {b.shape[1]} dimensions, the active model's {a.shape[1]}" if low is None else
            f"its vectors of the same texts have cosine min {low:.4f} with the active model's, below "
            f"{bound} (model.gate.int8_cosine_min)")
    return (f"the canary's embedding space differs from the active model's: {what} on {len(texts)} built-in "
            "texts. Clients indexing during a canary would store vectors of two spaces that no query can "
            "search together; shadow it instead (POST /admin/models/shadow: it never answers clients, and its "
            "drift report guards promotion), or force the canary (force: true)")


def on_worker(post_to_worker: PostToWorker | None, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the thread that runs batches and wait for its result."""
    done, box = threading.Event(), {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller below
            box["error"] = exc
        finally:
            done.set()

    (post_to_worker or (lambda c: c()))(call)
    if not done.wait(SPACE_TIMEOUT_S):
        raise ModelLoadError("the space check did not get the worker in time")
    if "error" in box:
        raise ModelLoadError(f"the space check failed: {box['error']}")
    return box["value"]


def _vectors(slot: ModelSlot, texts: list[str], post_to_worker: PostToWorker | None) -> np.ndarray:
    handler = slot.handler
    rows = []
    for k in range(0, len(texts), SPACE_BATCH):
        part = texts[k:k + SPACE_BATCH]
        # Made vectors inside the call too: a plug-in handler whose answers are not vectors fails the check there,
        # which the caller takes as "could not run", as any failure of the handler's.
        rows += on_worker(post_to_worker, lambda part=part: [
            np.asarray(r, dtype=np.float64) for r in handler.postprocess(handler.infer(handler.preprocess(part)))])
    return np.asarray(rows)
