"""A model's shadow slot: at most one candidate computing a sampled share of live requests beside the active
model, its drift report (core/shadow.py), and whether that report allows the candidate's promotion.

The slot holds state only; the slot table changes it as it changes the active and canary slots, under the
table's lock (core/slot_table.py), one model change at a time (core/rollout.py), so that no request sees a
candidate that is already the active model. Nothing here loads or frees a model.
"""

from __future__ import annotations

import hashlib
import logging

from inferd.core.errors import NoShadow, ShadowRefused
from inferd.core.shadow import MIN_ITEMS, DriftReport, Shadow, verdict
from inferd.core.slots import ModelSlot
from inferd.settings import Settings

log = logging.getLogger(__name__)


def sampled(weight: float, routing_key: str | None, draw: float) -> bool:
    """Whether a request is mirrored: by its routing key's bucket (stable per key; salted, so the keys the
    canary takes are not the ones shadowed), else by ``draw`` (a uniform number in [0, 1))."""
    if routing_key is not None:
        digest = hashlib.blake2b(b"shadow:" + routing_key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        draw = int.from_bytes(digest, "big") / 2**64
    return draw < weight


class ShadowSlot:
    """The candidate (None: no shadow), the share of requests it computes, and its report. Not locked: the
    slot table calls it under its lock."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.candidate: Shadow | None = None

    def report_for(self, slot: ModelSlot) -> DriftReport:
        """A fresh report of ``slot`` against the active model."""
        d = slot.description
        tuning = self.settings.shadow
        return DriftReport(slot.task, slot.version, labels=None if d.labels is None else list(d.labels),
                           multi_label=d.multi_label, log_inputs=self.settings.server.log_inputs,
                           window=tuning.window, neighbours=tuning.neighbours)

    def pick(self, routing_key: str | None, draw: float) -> Shadow | None:
        """The candidate, with a reference on its slot, if this request is sampled for it."""
        shadow = self.candidate
        if shadow is None or not sampled(shadow.weight, routing_key, draw):
            return None
        shadow.slot.acquire()
        return shadow

    def replace(self, slot: ModelSlot, weight: float) -> Shadow | None:
        """``slot`` becomes the candidate, with a report of its own; returns the one it replaces (to retire)."""
        old, self.candidate = self.candidate, Shadow(slot, weight, self.report_for(slot))
        return old

    def take(self) -> Shadow | None:
        """No candidate any more; returns the one there was (to retire, or to promote)."""
        old, self.candidate = self.candidate, None
        return old

    def active_changed(self) -> None:
        """The report compared with the previous active model: it starts afresh against the new one."""
        if self.candidate is not None:
            self.candidate.report = self.report_for(self.candidate.slot)

    def promotable(self, canary: ModelSlot | None, force: bool = False, min_items: int = MIN_ITEMS) -> Shadow:
        """The candidate, if its drift report allows its promotion (or ``force``); else why not, raised."""
        shadow = self.candidate
        if shadow is None:
            raise NoShadow("there is no shadow candidate to promote")
        if canary is not None:
            raise ShadowRefused("canary_set", f"a canary ({canary.version}) is being served; promote or roll "
                                "it back first")
        report = shadow.report
        decided = verdict(report.task, report.items, report.figures(), self.settings.model.gate, min_items)
        if not decided.ok:
            if not force:
                raise ShadowRefused(decided.code or "shadow_drifted", "shadow promotion refused: "
                                    + "; ".join(decided.reasons) + " (force: true overrides)")
            log.warning("shadow promotion forced against the drift report: %s", "; ".join(decided.reasons),
                        extra={"version": shadow.slot.version})
        return shadow
