"""A batch worker: on its own thread it takes the queue's hand-outs for its lanes and runs them.

It runs each batch (core/batch_compute.py: the handler's pass, split in halves on out-of-memory so only what
cannot fit fails) on the slot the queue claimed for it, on its instance's threads or, alone, on all of the model's.
It runs the calls posted to its thread (the manager's slot frees: freeing closes a handler and empties the device
cache, which must not block the event loop), and reports what happened as an outcome object (core/outcomes.py:
``BatchReport`` or ``Failure``) handed to ``deliver``. It never writes a request's outcome itself: the event loop
applies the outcome, and stays the only writer of a ticket.

A worker is one model instance (core/instances.py): it takes only its own model's lanes, under its own
thread count and CUDA stream. Every model's instances together are core/workers.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from queue import Empty, SimpleQueue
from typing import Any

from inferd.core.backends.base import all_threads
from inferd.core.background import LiveFirst, Paused
from inferd.core.batch_compute import BatchComputer, failed_batch
from inferd.core.batcher import BatchQueue, Handout
from inferd.core.errors import EngineError, Kind, deadline_passed
from inferd.core.instances import Instance, Sharing
from inferd.core.outcomes import Failure, Outcome, WorkItem, tickets_of
from inferd.core.shadow import SHADOW_SUFFIX
from inferd.core.slots import ModelSlot
from inferd.utils.metrics import Metrics
from inferd.utils.threads import name_os_thread

log = logging.getLogger(__name__)


def call_posted(calls: list[Callable[[], None]]) -> None:
    """The calls posted to the worker's thread (a slot's free, a space check): one failing does not stop the rest."""
    for call in calls:
        try:
            call()
        except Exception:
            log.exception("a call posted to the worker failed")


def _any_lane(lane: Any) -> bool:
    return True


class BatchWorker:
    def __init__(self, queue: BatchQueue, metrics: Metrics, memory_guard: Any,
                 deliver: Callable[[Outcome], None], instance: Instance | None = None,
                 guard_lock: threading.Lock | None = None, live_first: LiveFirst | None = None) -> None:
        """``instance``: the lanes it serves and its budget (None: every lane and kind of work, the process's
        threads); ``guard_lock``: shared by the workers that count into one memory guard; ``live_first``: the
        process's live batches, which background passes stop for (core/background.py; None: nothing stops)."""
        self.queue = queue
        self.metrics = metrics
        self.memory_guard = memory_guard
        self.deliver = deliver
        self.instance = instance
        self.error: str | None = None  # why the thread died (for the log and /admin/models)
        self.batches = BatchComputer(metrics, memory_guard,
                                     instance.running if instance is not None else contextlib.nullcontext)
        self._thread: threading.Thread | None = None
        self._retired = False
        self._dead = False  # the worker died: its stager takes nothing more
        # The stager's hand-over (core/staging.py): a handout and its staged inputs, and room for one ahead.
        self._handoff: SimpleQueue[Any] = SimpleQueue()
        self._handoff_lock = threading.Lock()  # a hand-over and the worker's death never interleave
        self._room = threading.Semaphore(1)
        self._serves = instance.serves if instance is not None else _any_lane
        self._guard_lock = guard_lock or threading.Lock()
        self._live_first = live_first

    # -- lifecycle (called from the event loop) --------------------------------------------------------

    def start(self) -> None:
        name = "inferd-worker" + ("" if self.instance is None else f"-{self.instance.model}-{self.instance.label}")
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self.metrics.worker_alive.set(1)

    def retire(self) -> None:
        """Stop once its lanes hold nothing it could take (its model was removed, or has fewer instances)."""
        self._retired = True
        self.queue.wake()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stop(self, timeout: float) -> None:
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            call_posted(self.queue.take_posted())  # frees posted as the worker stopped

    def on_worker(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the worker thread (a slot's free); here when this is the worker or there is none."""
        thread = self._thread
        if thread is None or not thread.is_alive() or threading.current_thread() is thread:
            call_posted([call])
        else:
            self.queue.post(call)

    # -- the thread ------------------------------------------------------------------------------------

    def _serve(self) -> None:
        """The thread: each handout handled in turn until the queue closes or the worker retires."""
        handout: Handout[WorkItem] | None = None
        # The OS's name (top -H, /proc): "inferd-bg" for a model's background worker, "inferd-<n>" for its n-th live
        # instance, "inferd-shadow"; its compute threads, started from here, take the same name.
        name_os_thread("inferd-" + (self.instance.os_label if self.instance is not None else "worker"))
        try:
            if self.instance is not None:
                self.instance.enter_thread()
            for handout, staged in self._handouts():
                try:
                    self._handle(handout, staged)
                except Exception:
                    # A fault outside the handler (metrics, memory guard): fail this handout, keep serving.
                    log.exception("handling a batch failed; its requests fail, the worker carries on")
                    self.deliver(Failure(tickets_of([*handout.batch, *handout.expired]), failed_batch()))
                handout = None
        except BaseException as exc:  # the loop must never die silently: readiness reports it
            self.error = f"{type(exc).__name__}: {exc}"
            self.metrics.worker_alive.set(0)
            log.critical("inference worker died", exc_info=True)
            err = EngineError(Kind.WORKER_DEAD, "the inference worker stopped")
            # The batch in hand and the one staged as well as the queue: none of their requests may wait for ever.
            in_hand = [] if handout is None else [*handout.batch, *handout.expired]
            in_hand += self._stop_stager()
            left = self.queue.drain_all(lanes=self._serves, background=self._takes_background)
            self.deliver(Failure(tickets_of([*in_hand, *left]), err))
            call_posted(self.queue.take_posted())
            raise

    def _take(self) -> Handout[WorkItem] | None:
        return self.queue.take(lanes=self._serves, background=lambda: self._takes_background,
                               runs_posted=self.runs_posted,
                               stop=lambda: self._retired or self._dead)

    @property
    def _takes_background(self) -> bool | None:
        """The work it takes (Instance.background; read each time: a SIGHUP may turn background_pauses off)."""
        return self.instance.background if self.instance is not None else None

    @property
    def _stages(self) -> bool:
        """Whether the next batch is taken and put on the device while this one runs (a GPU's live instance)."""
        return self.instance is not None and self.instance.copy_stream is not None and not self.instance.shadow

    def _handouts(self) -> Iterator[tuple[Handout[WorkItem], Any]]:
        """The handouts to run, each with its staged inputs (None: none staged). Without staging, taken one at
        a time as the worker is free; with it, the stager thread takes the next one as this one starts."""
        if not self._stages:
            while (handout := self._take()) is not None:
                yield handout, None
            return
        stager = threading.Thread(target=self._stage_loop, name=f"{threading.current_thread().name}-stager",
                                  daemon=True)
        stager.start()
        while (got := self._handoff.get()) is not None:
            if isinstance(got, BaseException):
                raise RuntimeError("the stager thread failed") from got
            self._room.release()  # this batch starts: the stager may take and stage the next one meanwhile
            yield got

    def _stage_loop(self) -> None:
        """The stager: takes the instance's next handout and copies its inputs to the device on the copy stream,
        one batch ahead of the worker at most."""
        try:
            while True:
                self._room.acquire()
                handout = None if self._dead else self._take()
                if handout is None:
                    break
                staged = self._stage(handout)
                with self._handoff_lock:
                    if not self._dead:
                        self._handoff.put((handout, staged))
                        continue
                # The worker died while this was taken: it is answered here, never held.
                self._unclaim(handout)
                self.deliver(Failure(tickets_of([*handout.batch, *handout.expired]),
                                     EngineError(Kind.WORKER_DEAD, "the inference worker stopped")))
                break
            self._handoff.put(None)
        except BaseException as exc:
            self._handoff.put(exc)

    def _stage(self, handout: Handout[WorkItem]) -> Any:
        instance = self.instance
        if not handout.batch or instance is None:
            return None
        slot = handout.batch[0].slot
        try:
            return slot.handler.stage([it.encoded for it in handout.batch], instance.copy_stream, instance.stream)
        except Exception:  # out of memory, say: the batch runs as it would have, unstaged
            log.warning("staging a batch on the device failed; it runs unstaged", exc_info=True)
            return None

    def _stop_stager(self) -> list[WorkItem]:
        """After the worker died: the stager takes nothing more; the items of what it had staged (their claims on
        the model let go, as a batch that ran lets go of its own)."""
        items: list[WorkItem] = []
        with self._handoff_lock:
            self._dead = True
            while True:
                try:
                    got = self._handoff.get_nowait()
                except Empty:
                    break
                if isinstance(got, tuple):
                    self._unclaim(got[0])
                    items += [*got[0].batch, *got[0].expired]
        self._room.release()
        self.queue.wake()
        return items

    @staticmethod
    def _unclaim(handout: Handout[WorkItem]) -> None:
        if handout.batch:
            handout.batch[0].slot.release()  # the claim the queue took for the batch (core/batcher.py)

    @property
    def runs_posted(self) -> bool:
        # Not the shadow instance nor a background worker: a model's free or a space check must not wait behind
        # shadow batches, or behind a background pass stopped for live work.
        return self.instance is None or not (self.instance.shadow or self.instance.background is True)

    def _handle(self, handout: Handout[WorkItem], staged: Any = None) -> None:
        expired = tickets_of(handout.expired)
        if expired:
            self.deliver(Failure(expired, deadline_passed()))
        if handout.batch:
            slot = handout.batch[0].slot
            live = not handout.lane.endswith(SHADOW_SUFFIX)  # shadow work stays out of the live metrics
            if self.instance is not None:
                self.instance.apply_threads(slot.capabilities.torch_threads)
            sharing = self._sharing(slot)
            on_background = self._takes_background is True
            if on_background:
                wide = self._background_wide(slot)
                if wide and sharing is not None:
                    sharing.enter_background()
            else:
                # Waits while a sibling runs alone on every thread: queue time for the batch, not this instance's busy.
                # A job's queued lines are no burst: a lone live batch beside them may still use every thread.
                wide = sharing is not None and sharing.enter(lambda: not self.queue.live_waiting(handout.lane))
            started = time.monotonic()
            paused = Paused()
            try:
                # wide: on every thread of the model's instances (a job's pass: live batches on their own streams)
                with all_threads(wide), self._first_live(slot, live, handout) as paused:
                    report = self.batches.compute(slot, handout.batch, live, staged)
            finally:
                if sharing is not None:
                    if not on_background:
                        sharing.leave(wide)
                    elif wide:
                        sharing.leave_background()
                slot.release()  # the claim the queue took for this batch; a retired slot is freed here
                took = time.monotonic() - started - paused.seconds  # stopped for live work: not this lane's time
                # The device time the lane's model took: the fair share between models (core/lanes.py).
                self.queue.charge(handout.lane, took)
                self._count(slot.spec.name, handout.batch, started, took)
            if report is not None:
                self.deliver(report)
            if live:
                self.metrics.queue_depth.labels(slot.spec.name).set(self.queue.depth(handout.lane))
        call_posted(handout.posted)
        if self.memory_guard is not None and handout.batch:
            with self._guard_lock:  # every instance's requests count into the one guard
                self.memory_guard.tick(len({id(i.ticket) for i in handout.batch}))

    @contextlib.contextmanager
    def _first_live(self, slot: ModelSlot, live: bool, handout: Handout[WorkItem]) -> Iterator[Paused]:
        """A live batch counted as running while it runs; a background one stopping for them (core/background.py).
        A live batch of one request with nothing queued behind it may run on half its threads beside a background
        pass that shares the cores; a burst keeps them all."""
        first = self._live_first
        if first is None or not live:  # shadow work neither stops nor is stopped for
            yield Paused()
        elif self._takes_background:
            nice = self.instance.nice if self.instance is not None else 0
            share = self.instance.share_cores if self.instance is not None else False
            with first.background(slot.handler.pause_points(), nice, share) as paused:
                yield paused
        else:
            lone = (first.sharing_now and len({id(item.ticket) for item in handout.batch}) == 1
                    and not self.queue.live_waiting(handout.lane))  # read only beside a sharing pass
            with first.live(narrowable=lone):
                yield Paused()

    @staticmethod
    def _background_wide(slot: ModelSlot) -> bool:
        """A background batch on every thread of the model, where its runner can widen (an OpenVINO graph of several
        instances: one instance's stream is one core of two), beside live work too: at nice 19 (core/background.py)
        the OS gives a live pass the cores first, and a live batch runs on its own instance's stream meanwhile
        (``Sharing.enter_background``), never waiting behind the job's. On one instance's stream beside live load a
        job kept x0.54-0.67 of its lines/s alone and online P99 rose x1.47-1.81; on every thread, with the bound of a
        job alone (core/scheduler.py), x0.71-0.84 and x1.12-1.53, medians 0.77 and 1.33 (bench/RESULTS.md, "A job on
        every thread beside live load")."""
        return slot.capabilities.can_use_all_threads

    def _sharing(self, slot: ModelSlot) -> Sharing | None:
        """The model's instances together, where its runner can run a batch on all of their threads."""
        sharing = self.instance.sharing if self.instance is not None else None
        return sharing if sharing is not None and slot.capabilities.can_use_all_threads else None

    def _count(self, model: str, batch: list[WorkItem], started: float, took: float) -> None:
        instance = self.instance
        if instance is None:
            return
        instance.batches += 1
        instance.busy_s += took
        label = instance.label
        m = self.metrics
        m.instance_busy.labels(model, label).inc(took)
        m.instance_batches.labels(model, label).inc()
        waited = m.instance_queue_wait.labels(model, label)
        for item in batch:
            waited.observe(max(0.0, started - item.enqueued))

    @property
    def batches_run(self) -> int:
        return self.batches.batches_run
