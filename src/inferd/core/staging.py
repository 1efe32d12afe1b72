"""The next batch's inputs on the device while the current batch runs: a GPU instance's overlap (issue 31).

On a GPU each instance (core/instances.py) runs its forward passes on a compute stream of its own. Without
overlap the next batch waits for the current one to finish, then is padded on the host and copied to the device,
and only then does its forward pass start: the copy is dead time on the device. With it, the instance's stager
thread (core/worker.py) takes the next batch from the queue as soon as the current one starts, pads it, and
copies it to the device on the instance's *copy* stream from page-locked memory; the compute stream waits for
that copy only (an event), so the copy runs beside the current forward pass, as text-embeddings-inference does.

The pieces are plain functions over a stream-like object (``record_event()``, ``wait_event(event)``, and a
context to run inside), so the unit tests drive them with fakes on a CPU. Nothing here runs on a CPU instance:
there the next batch is already tokenised at admission, and a stager thread would only compete for the cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inferd.core.preprocess import Encoded


class StagedBatch(list):
    """A batch (the list of ``Encoded`` it always was, so a handler that stages nothing reads it as before) and
    its padded inputs already on the device, ready once ``event`` has passed on the copy stream."""

    def __init__(self, batch: Sequence[Encoded], tensors: tuple[torch.Tensor | None, ...], event: Any,
                 compute: Any) -> None:
        super().__init__(batch)
        self.tensors = tensors
        self.event = event
        self.compute = compute

    def take(self) -> tuple[torch.Tensor | None, ...]:
        """The device inputs, for a forward pass on the instance's compute stream: it waits for the copy (on the
        device, not the host), and the copy's memory is kept from reuse until that stream is done with it."""
        self.compute.wait_event(self.event)
        for tensor in self.tensors:
            if tensor is not None and tensor.is_cuda:
                tensor.record_stream(self.compute)
        return self.tensors


def stream_context(stream: Any) -> Any:
    """torch's stream context for a real CUDA stream; a fake's own context (unit tests on the CPU)."""
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return stream


def to_device(tensors: Sequence[torch.Tensor | None], device: torch.device,
              copy: Any) -> tuple[tuple[torch.Tensor | None, ...], Any]:
    """``tensors`` copied to ``device`` on the ``copy`` stream, from page-locked host memory so the copy does not
    block the host; returns the copies and the event that marks them done on ``copy``."""
    with stream_context(copy):
        moved = tuple(None if t is None else _copy(t, device) for t in tensors)
        event = copy.record_event()
    return moved, event


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def same_batch(staged: Any, batch: Sequence[Encoded]) -> bool:
    """Whether ``staged`` still is ``batch`` (a request that left before its batch ran changes the batch)."""
    return isinstance(staged, StagedBatch) and len(staged) == len(batch) and all(
        a is b for a, b in zip(staged, batch, strict=True))
