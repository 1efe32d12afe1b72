"""What a forward pass can do that the layers above it plan around: one ``Capabilities`` value, said by the runner.

It is read where it is needed, never copied field by field: the scheduler's padding floor (core/scheduler.py, through
the batch's slot), a batch alone on every thread of its model (core/worker.py), the next batch's inputs put on the
device while this one runs (core/tasks/base.py ``ModelTask.stage``), a background pass stopped while live batches
run (core/background.py). A handler with no runner (a plug-in) has the defaults: it pads, it keeps to its instance's
threads, it stages nothing, it does not pause. No torch here: the scheduler reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Capabilities:
    # Whether padded positions cost compute (a batch costs its size times its longest text): the padding floor is
    # for a runner that pads; a batch on one that does not costs its real tokens, whatever their lengths.
    pads: bool = True
    # Whether a call inside ``all_threads`` (core/backends/base.py) runs on every thread of the model rather than
    # one instance's share (OpenVINO compiled for several instances; core/instances.py ``Sharing``).
    can_use_all_threads: bool = False
    # Whether the padded inputs may be copied to the device ahead of the pass (torch on a CUDA device; ONNX Runtime
    # and OpenVINO take host memory).
    stages: bool = False
    # Whether a pass can stop between its modules (``pause_points``) while live batches run, so a background batch
    # (a batch job's lines) gives the cores back within one module's time (core/background.py): torch on a CPU. A
    # compiled graph (OpenVINO, ONNX Runtime) runs whole once called.
    pauses: bool = False
    # Whether the pass computes on torch's intra-op threads. A compiled graph (OpenVINO, ONNX Runtime) has threads of
    # its own, and the torch work around it (collate, pooling, a head: small tensors) runs on one torch thread
    # (core/instances.py ``Instance.apply_threads``): a second OpenMP thread woken for it spun after each batch, or
    # took a core from the runtime's own threads (OpenVINO mixed, MiniLM, sorted batches of 4 on the model's two
    # threads: 6.1 -> 4.9 ms of CPU per text; bench/RESULTS.md, "torch's threads beside a compiled graph").
    torch_threads: bool = True
