"""Shadow mirroring: a sampled request's inputs, answered already, computed again by the shadow candidate
(core/shadow_slot.py) and both answers folded into its drift report (core/shadow.py).

Nothing of it runs before the live answer is sent, and nothing it does can reach the client: the mirrored work
runs in a task of its own, in the model's shadow lane (bounded, lowest priority: shed first, never counted as a
refusal), and a drain cancels it before anything else.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from inferd.core.batcher import BatchQueue, QueueClosed, QueueFull
from inferd.core.errors import Kind
from inferd.core.outcomes import TaskResult, Ticket, WorkItem
from inferd.core.preprocess import InputError
from inferd.core.registry import ServedModel
from inferd.core.shadow import SHADOW_PRIORITY, SHADOW_TIMEOUT_S, DriftReport, Shadow, shadow_lane, shadow_policy
from inferd.core.text_options import InputOptions
from inferd.core.tokenizing import Tokenizing
from inferd.utils.logger import request_id_var
from inferd.utils.metrics import Metrics

log = logging.getLogger(__name__)


class ShadowMirror:
    def __init__(self, queue: BatchQueue, metrics: Metrics, tokenizing: Tokenizing) -> None:
        self.queue = queue
        self.metrics = metrics
        self.tokenizing = tokenizing
        # Mirrored requests in flight to a shadow candidate: cancelled by a drain.
        self._tasks: set[asyncio.Task] = set()

    def cancel(self) -> None:
        """A drain sheds shadow work first: its queued items leave as each task ends."""
        for task in list(self._tasks):
            task.cancel()

    def mirror(self, served: ServedModel, routing_key: str | None, inputs: list[Any], options: InputOptions,
               live: TaskResult) -> None:
        """On the event loop: a sampled request's inputs (encoded as ``options`` say), answered already, go to the
        shadow candidate in a task of their own."""
        try:
            shadow = served.manager.pick_shadow(routing_key, random.random())
            if shadow is None:
                return
            # The report of the active model that answered: a reload or promotion while the candidate computes starts
            # a new one (against the new active), which this comparison must not join.
            report = shadow.report
            report.count("sampled")
            self.metrics.shadow_requests.labels(served.name, "sampled").inc()
            task = asyncio.get_running_loop().create_task(
                self._compare_on_shadow(served, shadow, report, inputs, options, live, request_id_var.get()))
        except Exception:  # whatever goes wrong here, the live answer is given
            log.exception("mirroring a request to the shadow candidate failed", extra={"model": served.name})
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _compare_on_shadow(self, served: ServedModel, shadow: Shadow, report: DriftReport, inputs: list[Any],
                                 options: InputOptions, live: TaskResult, request_id: str | None) -> None:
        """Tokenise for the candidate, queue in the model's shadow lane, and fold both answers into the report.
        Holds the candidate's slot."""
        slot, name, lane = shadow.slot, served.name, shadow_lane(served.name)
        outcome, ticket, items = "shed", None, []
        try:
            await asyncio.sleep(0)  # the live response goes out first
            if self.tokenizing.would_wait(inputs):
                return  # shed: live requests are waiting for the tokenizer's thread
            encoded = await self.tokenizing.encode(slot, inputs, options)
            policy, bound = shadow_policy(served.policy, served.settings.shadow), served.settings.shadow.max_queue
            if self.queue.lane_rules(lane) != (policy, bound):  # absent, or the settings changed (SIGHUP)
                self.queue.add_lane(lane, policy, bound, shadow=True)
            ticket = Ticket(asyncio.get_running_loop().create_future(), len(encoded))
            now = time.monotonic()
            items = [WorkItem(ticket, i, enc, enc.tokens, SHADOW_PRIORITY, now, now + SHADOW_TIMEOUT_S,
                              self.queue.next_seq(), slot) for i, enc in enumerate(encoded)]
            try:
                self.queue.put(items, lane)
            except (QueueFull, QueueClosed):
                return  # shed: the lane is full (or the server stops)
            self.metrics.shadow_queue_depth.labels(name).set(self.queue.depth(lane))
            await ticket.future
            error = ticket.error
            if error is not None:
                outcome = "shed" if error.kind in (Kind.DEADLINE, Kind.DRAINING) else "failed"
                return
            figures = report.add(live.outputs, ticket.results, request_id, live.tokens, inputs)
            outcome = "computed"
            self._publish(name, shadow, figures)
        except InputError:
            outcome = "failed"  # the candidate's tokenizer refused what the active model took
        except asyncio.CancelledError:
            outcome = "shed"
        except Exception:
            outcome = "failed"
            log.exception("shadow work failed; live traffic is not affected", extra={"model": name})
        finally:
            if ticket is not None and not ticket.closed:
                ticket.close()
            if items and self.queue.remove(items):
                self.metrics.shadow_queue_depth.labels(name).set(self.queue.depth(lane))
            slot.release()
            if outcome != "computed":
                report.count(outcome)
            self.metrics.shadow_requests.labels(name, outcome).inc()

    def _publish(self, name: str, shadow: Shadow, figures: dict[str, Any]) -> None:
        m = self.metrics
        for cosine in figures.get("cosine", ()):
            m.shadow_cosine.labels(name).observe(cosine)
        for figure, value in shadow.report.figures().items():
            if value is not None:
                m.shadow_figures.labels(name, figure).set(value)
