"""Fake task handlers for batching tests: deterministic, observable and steerable through their input.

A server loads one with ``INFERD__MODEL__TASK=fakes:HashHandler`` (the ``serve`` fixture puts tests/ on
PYTHONPATH). The output of a text is a function of that text alone (``vector_for``), so a test can tell
whether results crossed between requests. Marker prefixes steer a batch that contains them:

- ``hold:NAME ...``  the batch blocks until the file ``$FAKE_GATE_DIR/NAME`` exists (a held worker);
- ``fail:...``       infer raises RuntimeError (a failing batch);
- ``die:...``        infer raises SystemExit, which the worker does not survive (in-process tests only).

Loading is steerable too: while the file ``$FAKE_LOAD_HOLD`` exists, ``load`` waits (a worker still loading).

Every infer call is recorded before it computes: in ``handler.batches`` and, when ``$FAKE_RECORD`` names a
file, as one JSON line ``{"texts": [...]}`` there, so a test in another process sees what was computed.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from tokenizers import Tokenizer

from inferd.core.capabilities import Capabilities
from inferd.core.description import Loaded, TaskFacts
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler

DIM = 8
H = TypeVar("H", bound=Handler)
# A held batch gives up after this long, so a broken test cannot hang a server forever.
HOLD_LIMIT_S = 60.0


def vector_for(text: str) -> list[float]:
    """The fake embedding of a text: multiples of 1/64, exact in float32, JSON and float64 alike."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return [(b - 128) / 64 for b in digest[:DIM]]


def encode(text: str) -> Encoded:
    # One "token" per character, so a test sets a text's cost by its length; infer can recover the text.
    return Encoded([ord(c) for c in text], False)


def decode(enc: Encoded) -> str:
    return "".join(map(chr, enc.ids))


def read_record(path: Path) -> list[list[str]]:
    """The batches a server's HashHandler computed, in order, from its ``$FAKE_RECORD`` file."""
    if not path.exists():
        return []
    return [json.loads(line)["texts"] for line in path.read_text(encoding="utf-8").splitlines() if line]


class HashHandler(Handler):
    """Implements the Handler contract with no model: vector_for(text) per text, one result per item. What its load
    says (``Loaded``) is read from these class members, which a subclass or a test sets before the load."""

    dimension = DIM
    max_seq_length = 100_000
    capabilities = Capabilities()
    tokenizer: Tokenizer | None = None

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.record: Path | None = None
        self.gate_dir: Path | None = None
        # In-process tests hold batches with events instead of files: name -> event.
        self.gates: dict[str, threading.Event] = {}
        self.closed = False

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        record, gate_dir = os.environ.get("FAKE_RECORD"), os.environ.get("FAKE_GATE_DIR")
        hold = os.environ.get("FAKE_LOAD_HOLD")
        give_up = time.monotonic() + HOLD_LIMIT_S
        while hold and Path(hold).exists():
            if time.monotonic() > give_up:
                raise RuntimeError(f"load hold {hold} was never removed")
            time.sleep(0.05)
        self.record = Path(record) if record else None
        self.gate_dir = Path(gate_dir) if gate_dir else None
        return Loaded(facts=self.facts(), max_seq_length=self.max_seq_length,
                      device="cpu" if device is None else str(device), dtype="float32",
                      capabilities=self.capabilities, tokenizer=self.tokenizer)

    def facts(self) -> TaskFacts:
        """What its load says of the model: its vectors' size (a subclass says more)."""
        return TaskFacts(dimension=self.dimension)

    def preprocess(self, texts: list[str]) -> list[Encoded]:
        return [encode(t) for t in texts]

    def infer(self, batch: list[Encoded]) -> list[str]:
        texts = [decode(e) for e in batch]
        self.batches.append(texts)
        if self.record is not None:
            with self.record.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"texts": texts}) + "\n")
        for text in texts:
            if text.startswith("hold:"):
                self._hold(text[5:].split()[0])
            elif text.startswith("fail:"):
                raise RuntimeError(f"the fake fails on {text!r}")
            elif text.startswith("die:"):
                raise SystemExit(f"the fake kills the worker on {text!r}")
        return texts

    def _hold(self, name: str) -> None:
        event = self.gates.get(name)
        if event is not None:
            if not event.wait(HOLD_LIMIT_S):
                raise RuntimeError(f"gate {name} was never opened")
            return
        assert self.gate_dir is not None, "hold: needs FAKE_GATE_DIR or an in-process gate"
        give_up = time.monotonic() + HOLD_LIMIT_S
        while not (self.gate_dir / name).exists():
            if time.monotonic() > give_up:
                raise RuntimeError(f"gate file {name} never appeared")
            time.sleep(0.01)

    def postprocess(self, outputs: list[str]) -> list[list[float]]:
        return [vector_for(t) for t in outputs]

    def close(self) -> None:
        self.closed = True


class ShortHandler(HashHandler):
    """Breaks the batch contract: one result too few for any batch of more than one item."""

    def postprocess(self, outputs: list[str]) -> list[Any]:
        results = super().postprocess(outputs)
        return results[:-1] if len(results) > 1 else results


class PacedHandler(HashHandler):
    """Costs ``$FAKE_SECONDS_PER_TOKEN`` per real token of a batch: a queue drains at a known pace (fair shares)."""

    def infer(self, batch: list[Encoded]) -> list[str]:
        out = super().infer(batch)
        time.sleep(float(os.environ.get("FAKE_SECONDS_PER_TOKEN", "0")) * sum(len(e.ids) for e in batch))
        return out


def opened(handler: H, spec: ModelSpec) -> H:
    """The handler, opened on the CPU as a load opens it (``Handler.open``): what a slot is made of."""
    handler.open(spec, torch.device("cpu"))
    return handler


def loader_for(handler: Handler) -> Callable[[ModelSpec], Handler]:
    """A ModelManager loader that 'loads' this very handler instance on the CPU."""
    return lambda spec: opened(handler, spec)


class FakeHandler(Handler):
    """What the model manager needs of a handler and no more (tests of the manager and of a load's guard); the
    dimension is read from the folder's name ("dim48-...", else 32). It is opened as it is made, as a loader's
    handler is."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.version = spec.version
        name = spec.path.name
        self.dimension = int(name[3:name.index("-")]) if name.startswith("dim") else 32
        self.closed = False
        self.open(spec, torch.device("cpu"))

    def load(self, spec: ModelSpec, device: Any) -> Loaded:
        return Loaded(facts=TaskFacts(dimension=self.dimension), max_seq_length=128, device="cpu", dtype="float32")

    def preprocess(self, inputs: list[Any]) -> list[Any]:
        return inputs

    def infer(self, batch: list[Any]) -> list[Any]:
        return batch

    def postprocess(self, outputs: list[Any]) -> list[Any]:
        return outputs

    def close(self) -> None:
        self.closed = True
