"""The canary's space check runs on the worker thread as small posted calls, so live batches run between them: the
whole check in one call (64 texts through both models) held live requests 1.7 s behind a canary's POST."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from inferd.core import space_check


class Recorder:
    """A handler that embeds each text as [len(text), 1] and records its batches' sizes."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def preprocess(self, texts: list[str]) -> list[str]:
        return texts

    def infer(self, batch: list[str]) -> list[str]:
        self.batches.append(len(batch))
        return batch

    def postprocess(self, outputs: list[str]) -> list[list[float]]:
        return [[float(len(t)), 1.0] for t in outputs]


def test_each_posted_call_is_one_small_batch_and_the_vectors_are_every_text_s() -> None:
    posted: list[Any] = []

    def post(call: Any) -> None:
        posted.append(call)
        call()  # the worker runs it between two live batches

    handler = Recorder()
    texts = [f"text {'x' * i}" for i in range(64)]
    vectors = space_check._vectors(SimpleNamespace(handler=handler), texts, post)  # type: ignore[arg-type]
    assert len(posted) == 64 // space_check.SPACE_BATCH and handler.batches == [space_check.SPACE_BATCH] * len(posted)
    assert [row[0] for row in vectors] == [float(len(t)) for t in texts]
