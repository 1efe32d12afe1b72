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
points; its background batches run beside the live ones, their tokens bounded while live requests arrive
(core/scheduler.py). Where the runner can widen (an OpenVINO graph of several instances) a background batch runs on
every thread of the model, beside live load too (core/worker.py ``_background_wide``), with its full bound: a live
batch runs on its own instance's stream meanwhile, never behind it, and the background worker's thread runs at a
raised nice value (``batching.background_nice``, 19), so that the OS gives the cores to live threads first. On
OpenVINO mixed with 2 cores the job then kept x0.71-0.84 of its lines/s alone beside online load (median 0.77),
online P99 x1.12-1.53 (median 1.33); on one instance's stream x0.54-0.67 and x1.47-1.81 (bench/RESULTS.md, "A job on
every thread beside live load"). On torch the pause points do that work and the thread keeps its priority: a niced
thread holding the GIL between its torch calls would keep live threads waiting.

With ``batching.background_shares_cores`` a torch pass that meets a lone live batch goes on instead, on half its
intra-op threads, while the live pass runs on the other half (a burst of live requests, or a live batch that began
before the pass, keeps every thread and is stopped for as above). On 2 cores the job then kept x0.73-0.80 of its
throughput alone where stopping kept x0.72-0.79, and online P99 beside it rose x1.29-1.70 where stopping gave
x0.63-1.84 (bench/RESULTS.md, "Sharing the cores"): the same trade from its other side, so it is off by default.

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

import torch

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


def _narrow() -> int:
    """This thread's torch passes on half its intra-op threads (at least one) from now; returns its count before.
    torch keeps the count per calling thread once the thread is initialised (core/instances.py)."""
    wide = torch.get_num_threads()
    torch.set_num_threads(max(1, wide // 2))
    return wide


@contextlib.contextmanager
def _narrowed() -> Iterator[None]:
    """This thread on half its intra-op threads meanwhile; its own count after."""
    wide = _narrow()
    try:
        yield
    finally:
        torch.set_num_threads(wide)


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
        self._live_wide = 0  # ... of them on their whole thread count
        self._waiting = 0  # background passes stopped now
        self._sharing = 0  # background passes computing now that share the cores rather than stop
        self._closed = False

    @contextlib.contextmanager
    def live(self, narrowable: bool = True) -> Iterator[None]:
        """Around a live batch's pass: background passes stop at their next pause point until it ends; where one
        computing now shares the cores (``batching.background_shares_cores``) and the pass is ``narrowable`` (a
        lone request, nothing queued behind it), this pass runs on half this thread's intra-op threads instead,
        and that background pass on the other half. A burst of live requests keeps every thread: on half, each
        would wait longer for the ones before it."""
        with self._cond:
            narrow = narrowable and self._sharing > 0
            self._live += 1
            self._live_wide += not narrow
        try:
            if narrow:
                with _narrowed():
                    yield
            else:
                yield
        finally:
            with self._cond:
                self._live -= 1
                self._live_wide -= not narrow
                if self._live == 0 and self._waiting:
                    self._cond.notify_all()

    @property
    def sharing_now(self) -> bool:
        """Whether a background pass that shares the cores computes now (a live batch may then run narrow)."""
        return self._sharing > 0

    def close(self) -> None:
        """Stopping: no background pass waits any longer (the workers are being joined)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _wait_for_quiet(self, paused: Paused, sharing: bool = False) -> None:
        if not self._live:  # one int read: a pass with no live batch beside it goes on at once
            return
        started = time.monotonic()
        with self._cond:
            self._waiting += 1
            self._sharing -= sharing  # a live batch that starts meanwhile has the cores to itself
            try:
                while self._live and not self._closed:
                    self._cond.wait()
            finally:
                self._waiting -= 1
                self._sharing += sharing
        paused.seconds += time.monotonic() - started
        paused.times += 1

    @contextlib.contextmanager
    def background(self, points: list[Any], nice: int = 0, share: bool = False) -> Iterator[Paused]:
        """Around a background batch's pass on this thread: it stops before each of ``points`` (torch modules)
        while a live batch runs. The hooks are on the shared modules for this pass only, and act on this thread
        only. A pass with no points runs at OS priority ``nice`` (``batching.background_nice``).

        ``share``: rather than stop, the pass goes on at its next point on half its intra-op threads while live
        batches run on the other half (they start narrow while it computes; one that started on its whole count
        before it is still waited for), and widens again at the first point with no live batch."""
        paused = Paused()
        if not points:
            _set_nice(nice)
            yield paused
            return
        _set_nice(0)
        me = threading.get_ident()
        wide = 0  # this pass's own count while it runs narrowed; 0: not narrowed

        def stop_here(module: Any, args: Any) -> None:
            nonlocal wide
            if threading.get_ident() != me:
                return
            if not share:
                self._wait_for_quiet(paused)
            elif not self._live:
                if wide:
                    torch.set_num_threads(wide)
                    wide = 0
            elif self._live_wide:
                self._wait_for_quiet(paused, sharing=True)
            elif not wide:
                wide = _narrow()

        handles = [point.register_forward_pre_hook(stop_here) for point in points]
        if share:
            with self._cond:
                self._sharing += 1
        try:
            yield paused
        finally:
            for handle in handles:
                handle.remove()
            if share:
                with self._cond:
                    self._sharing -= 1
            if wide:
                torch.set_num_threads(wide)
