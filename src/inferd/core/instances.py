"""Model instances: the workers that run batches, each with its own compute budget.

With one inference worker for every model's batches, a one-text embedding waits for a whole 32-pair rerank
batch of another model, and a live request for a shadow batch (bench/RESULTS.md, "Pipeline"). So each served
model gets ``model.instances`` workers of its own, and every model's shadow lane one more; each worker takes only
its own lanes' batches (``BatchQueue.take(lanes=...)``), so batches of different instances run at the same time and
share no barrier.

An instance's budget is a number of intra-op threads. torch's ``set_num_threads`` is per calling thread under its
OpenMP backend once that thread has been initialised (torch 2.13: a worker thread that asks for one thread keeps one
while the thread beside it runs two, as tests/unit/test_instances.py checks; a thread not yet initialised copies the
last count any thread set), so each worker initialises its thread, then sets its own count. How many instances and
threads each model gets is core/budgets.py's arithmetic, resolved once at start. OpenVINO and ONNX Runtime get theirs
from the model's load (core/backends/base.py ``options_for``: streams and threads per compiled model); a batch that
is an OpenVINO model's only work runs on all of its instances' threads (``Sharing``, below). By default the
machine's cores are split evenly between every live instance, never more than one core each way; ``model.threads``
sets a model's own.
On a GPU each instance runs on its own CUDA stream, and copies its next batch's inputs to the device on a second one
while the current batch computes (core/staging.py, the stager in core/worker.py). The shadow instance has one thread
and is counted in no budget: it takes a batch only while no live lane holds work (core/batcher.py), and its batches
are capped (shadow.max_batch_size), so what it adds to the live instances' cores is one small batch at a time. It
runs at the OS's normal priority on purpose: a thread niced down holds the GIL between its torch calls, and on a
busy machine the live threads then wait on a thread the OS seldom schedules. Each model also has a background worker
(batch jobs' lines), outside the budget too: its pass stops while any live batch runs (core/background.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from inferd.core.staging import stream_context
from inferd.settings import ModelEntry

SHADOW_INSTANCE = "shadow"
BACKGROUND_INSTANCE = "background"


def _new_stream(device: str) -> Any:
    """A CUDA stream of its own on a GPU; None on a CPU (the instance's threads are its budget there)."""
    if (device == "auto" or device.startswith("cuda")) and torch.cuda.is_available():
        return torch.cuda.Stream(torch.device(device))
    return None


class Sharing:
    """The instances of one model, and whether one batch runs on every thread of the model.

    Instances of one thread each serve the most at many clients, but a lone request on one thread took 1.3-1.6x as
    long as on two (OpenVINO bf16; bench/RESULTS.md, "Alone on every thread"). So a batch that is its model's only work
    (no sibling running, nothing of the model left queued) runs on every thread (when ``can_use_all_threads``), and a
    sibling that takes a batch meanwhile waits for that one to end instead of running beside it, which would
    oversubscribe the cores. Running on every thread is an opportunity, never a wait: a batch runs on its own share
    whenever any sibling is running. The model's background worker runs a job's batches on every thread
    (core/worker.py ``_background_wide``): meanwhile a live batch runs on its own share, never on the threads the
    job's pass holds, and the job's next pass waits while a live batch has every thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0  # siblings running on their own share
        self._one_on_all_threads = False
        self._background = False  # the model's background worker runs a pass on every thread

    def enter_background(self) -> None:
        """The background worker, before a pass on every thread: waits while a live batch runs on every thread."""
        with self._cond:
            while self._one_on_all_threads:
                self._cond.wait()
            self._background = True

    def leave_background(self) -> None:
        """After the pass ``enter_background`` let in."""
        with self._cond:
            self._background = False
            self._cond.notify_all()

    def enter(self, nothing_queued: Callable[[], bool]) -> bool:
        """Before a batch; True: run it on every thread of the model. Waits while a sibling runs on every thread."""
        with self._cond:
            while self._one_on_all_threads:
                self._cond.wait()
            if self._running == 0 and not self._background and nothing_queued():
                self._one_on_all_threads = True
                return True
            self._running += 1
            return False

    def leave(self, on_all_threads: bool) -> None:
        """After the batch ``enter`` let in (whatever happened in it); ``on_all_threads``: what ``enter`` said."""
        with self._cond:
            if on_all_threads:
                self._one_on_all_threads = False
            else:
                self._running -= 1
            self._cond.notify_all()


@dataclass
class Instance:
    """One worker's identity and budget: the model it serves (its lanes), its index, its threads, its stream."""

    model: str
    index: int | str  # 0, 1, ... for a model's instances; SHADOW_INSTANCE, BACKGROUND_INSTANCE for those
    threads: int  # its intra-op threads (0: left as torch sets them)
    serves: Callable[[Any], bool]  # whether a queue lane's batches are this instance's to run
    stream: Any = None  # on a GPU, the CUDA stream its batches compute on; None on a CPU
    shadow: bool = False
    # On a GPU, a second stream the next batch's inputs are copied on while this one computes (core/staging.py);
    # None: no overlap (a CPU, or the shadow instance).
    copy_stream: Any = None
    # The model's instances together (None: it has one); set by core/worker.py Workers.
    sharing: Sharing | None = None
    # The work it takes of its lanes (core/batcher.py ``take``): False its live requests (a model's instances),
    # True only background items (the model's background worker, core/background.py), None both (the shadow's).
    background: bool | None = False
    # The background worker's OS priority for passes that cannot pause (``batching.background_nice``; 0: none).
    nice: int = 0
    # Whether the background worker's torch pass shares the cores with live batches rather than stop for them
    # (``batching.background_shares_cores``; core/background.py).
    share_cores: bool = False
    # What /admin/models and the metrics read; written by the worker thread only.
    batches: int = 0
    busy_s: float = 0.0
    _applied: int = field(default=0, repr=False)
    _own: int = field(default=0, repr=False)

    @property
    def label(self) -> str:
        return str(self.index)

    @property
    def os_label(self) -> str:
        """The short name its worker thread has for the OS (utils/threads.py)."""
        if self.shadow:
            return "shadow"
        return "bg" if self.background is True else self.label

    def enter_thread(self) -> None:
        """On the worker's own thread, before its first batch."""
        self.apply_threads()

    def apply_threads(self, torch_compute: bool = True) -> None:
        """This thread's intra-op count, when it changed (a SIGHUP that adds instances splits the cores anew): its
        own, or one for a batch whose pass computes on threads of its own (``torch_compute`` False: a compiled
        graph, ``Capabilities.torch_threads``), so the torch work around it wakes no second thread."""
        if not self._own:
            # Initialise the thread first: its first parallel call would otherwise copy the last count set by any
            # thread over the one set here. Its count then is its own when the instance has none (threads 0).
            self._own = torch.get_num_threads()
        count = (self.threads or self._own) if torch_compute else 1
        if count != self._applied:
            torch.set_num_threads(count)
            self._applied = count

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """A batch's device context: its own CUDA stream, so instances on one GPU overlap."""
        if self.stream is None:
            yield
            return
        with stream_context(self.stream):
            yield


def live_lane(model: str) -> Callable[[Any], bool]:
    """Serves ``model``'s own lane (its live requests), not its shadow lane."""
    return lambda lane: lane.name == model and not lane.shadow


def shadow_lanes(lane: Any) -> bool:
    """Serves every model's shadow lane: the one shadow instance's."""
    return bool(lane.shadow)


def plan(entry: ModelEntry, device: str = "cpu") -> list[Instance]:
    """The instances of one served model, as its (budget-resolved) entry says."""
    return [Instance(entry.name, i, entry.model.threads, live_lane(entry.name), _new_stream(device),
                     copy_stream=_new_stream(device))
            for i in range(entry.model.instances)]


def shadow_instance(device: str = "cpu") -> Instance:
    """The worker of every model's mirrored work: one thread, in no budget."""
    return Instance("", SHADOW_INSTANCE, 1, shadow_lanes, _new_stream(device), shadow=True, background=None)


def background_instance(model: str, threads: int, device: str = "cpu") -> Instance:
    """The worker of a model's background items (batch jobs' lines, core/background.py): on the threads of the
    model's instances together (0: as torch sets them), in no budget of its own: it stops while live batches run."""
    return Instance(model, BACKGROUND_INSTANCE, threads, live_lane(model), _new_stream(device), background=True)
