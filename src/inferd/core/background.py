"""Live first: a background batch (a batch job's lines) stops between its layers while a live batch runs.

A batch job keeps its model's cores busy, and a live request that arrives while a background batch computes used to
wait for the whole of it: bounding those batches' tokens (core/scheduler.py) cut a job's cost to online P99 from
x37 to about x2, and tighter bounds cost the job up to a third of its throughput (bench/RESULTS.md, "A batch job
beside online traffic"). So each model has a background worker of its own (core/workers.py) that takes only
background batches, beside its live instances that take only live ones, and its pass stops before each of the
model's pause points (a torch model's linear layers: ``Handler.pause_points``) while any live batch runs anywhere in
the process. A live request then waits for one linear layer of a background batch, not the batch: online P99
beside a job went from x2.3-2.5 to x1.1-1.25 on 2 cores (bench/RESULTS.md, "Issue 42: live first"), while the job
kept x0.64-0.73 of its throughput alone where one queue kept x0.76-0.78 (``batching.background_pauses: false`` is
that other trade).

Stopping is cooperative and in-process: a hook on each pause point, installed for the background batch's pass only
and acting only on the background worker's thread (a live batch on the same modules passes through at once). The
thread waits on a condition, so it holds neither the GIL nor a core while it waits. Lowering the OS priority of
the background thread instead was ruled out: a thread niced down holds the GIL between its torch calls, and the live
threads then wait on a thread the OS seldom schedules (core/instances.py says the same of the shadow instance).
A runner whose pass runs whole once called (OpenVINO, ONNX Runtime: ``capabilities.pauses`` false) has no pause
points; its background batches run beside the live ones, bounded as before, and after a quiet spell with no live
request on every thread of the model (core/worker.py ``_background_alone``). There the background worker's thread
runs at a raised nice value (``batching.background_nice``, 19), so that the OS gives the cores to live threads
first: on OpenVINO mixed with 2 cores, online P99 beside a job went from 41.6-48.7 to 35.9-36.5 ms, the job's lines/s
beside that load from 194-198 to 182-195 (bench/RESULTS.md, "A background pass at nice 19"). On torch the pause
points do that work and the thread keeps its priority: a niced thread holding the GIL between its torch calls would
keep live threads waiting.

A background pass is never stopped for good: between two live batches it runs on to its next pause point, so under a
live load that never lets up it still moves, one layer per gap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


_thread = threading.local()


def _set_nice(nice: int) -> None:
    """This thread's OS priority (its nice value) for the passes to come, where it changes. Raising it needs no
    privilege; lowering it back does (a container's user has none), so a worker whose model moved from a graph to
    torch keeps the raised value: it says so once, and its torch passes still stop for live work."""
    current = getattr(_thread, "nice", 0)
    if nice == current or getattr(_thread, "stuck", False):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        _thread.stuck = True
        log.warning("the background worker stays at nice %d (%s): lowering a thread's nice value needs "
                    "CAP_SYS_NICE or a raised RLIMIT_NICE", current, exc)
        return
    _thread.nice = nice


@dataclass
class Paused:
    """What one background pass spent stopped (the worker charges the lane its compute, not its waits)."""

    seconds: float = 0.0
    times: int = 0


class LiveFirst:
    """The live batches running now, which every background pass stops for (one per process: core/workers.py)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._live = 0  # live batches computing now
        self._waiting = 0  # background passes stopped now
        self._closed = False

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        """Around a live batch's pass: background passes stop at their next pause point until it ends."""
        with self._cond:
            self._live += 1
        try:
            yield
        finally:
            with self._cond:
                self._live -= 1
                if self._live == 0 and self._waiting:
                    self._cond.notify_all()

    @property
    def live_now(self) -> int:
        return self._live

    def close(self) -> None:
        """Stopping: no background pass waits any longer (the workers are being joined)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _wait_for_quiet(self, paused: Paused) -> None:
        if not self._live:  # one int read: a pass with no live batch beside it goes on at once
            return
        started = time.monotonic()
        with self._cond:
            self._waiting += 1
            try:
                while self._live and not self._closed:
                    self._cond.wait()
            finally:
                self._waiting -= 1
        paused.seconds += time.monotonic() - started
        paused.times += 1

    @contextlib.contextmanager
    def background(self, points: list[Any], nice: int = 0) -> Iterator[Paused]:
        """Around a background batch's pass on this thread: it stops before each of ``points`` (torch modules)
        while a live batch runs. The hooks are on the shared modules for this pass only, and act on this thread
        only. A pass with no points runs at OS priority ``nice`` (``batching.background_nice``)."""
        paused = Paused()
        if not points:
            _set_nice(nice)
            yield paused
            return
        _set_nice(0)
        me = threading.get_ident()

        def stop_here(module: Any, args: Any) -> None:
            if threading.get_ident() == me:
                self._wait_for_quiet(paused)

        handles = [point.register_forward_pre_hook(stop_here) for point in points]
        try:
            yield paused
        finally:
            for handle in handles:
                handle.remove()
