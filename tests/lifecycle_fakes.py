"""A slow fake task handler for drain tests, loaded by a real server as ``lifecycle_fakes:SlowHandler``.

No weights: each text's vector is a function of the text (``vector_for``), so a test can check every
answer. Each batch takes ``$LIFECYCLE_DELAY_S`` seconds (default 0.3), which keeps requests in flight
long enough to send a signal among them; a batch holding a text that starts with ``stall`` takes
``$LIFECYCLE_STALL_S`` (default 120) instead: a request still stuck when the drain times out. While the file
``$LIFECYCLE_HOLD_FILE`` names exists, every batch waits for it to go (at most the stall time): the worker is
held, so a test knows its requests are still waiting when it changes the model under them.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import torch

from inferd.core.description import Loaded, TaskFacts
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler
from inferd.core.tasks.embedding import EmbeddingHandler

DIM = 4


def vector_for(text: str) -> list[float]:
    """Multiples of 1/64: exact through float32 and JSON."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return [(b - 128) / 64 for b in digest[:DIM]]


class SlowHandler(Handler):
    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        self.delay = float(os.environ.get("LIFECYCLE_DELAY_S", "0.3"))
        self.stall = float(os.environ.get("LIFECYCLE_STALL_S", "120"))
        self.hold = os.environ.get("LIFECYCLE_HOLD_FILE")
        return Loaded(facts=TaskFacts(dimension=DIM), max_seq_length=512, device="cpu", dtype="float32")

    def preprocess(self, texts: list[str]) -> list[Encoded]:
        # One "token" per character, so infer can recover the text.
        return [Encoded([ord(c) for c in text], False) for text in texts]

    def infer(self, batch: list[Encoded]) -> list[str]:
        texts = ["".join(map(chr, enc.ids)) for enc in batch]
        held_until = time.monotonic() + self.stall
        while self.hold and os.path.exists(self.hold) and time.monotonic() < held_until:
            time.sleep(0.01)
        time.sleep(self.stall if any(t.startswith("stall") for t in texts) else self.delay)
        return texts

    def postprocess(self, outputs: list[str]) -> list[Any]:
        return [vector_for(t) for t in outputs]

    def close(self) -> None:
        pass


class SlowEmbedding(EmbeddingHandler):
    """A real embedding model (a tiny BERT folder, so a tokenizer that long documents are split on) whose every
    batch takes ``$LIFECYCLE_DELAY_S`` seconds more: a document's waves are still running when a signal comes."""

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        self.delay = float(os.environ.get("LIFECYCLE_DELAY_S", "0.3"))
        return super().load(spec, device)

    def infer(self, batch: list[Encoded]) -> Any:
        time.sleep(self.delay)
        return super().infer(batch)
