"""A slot says whether padding costs its model compute with its runner's one capabilities value (held, not copied
apart): the scheduler's padding floor (core/scheduler.py) follows it."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import HashHandler, opened

from inferd.core.capabilities import Capabilities
from inferd.core.loading import load_handler
from inferd.core.slots import ModelSlot
from inferd.core.spec import ModelSpec


@pytest.mark.parametrize(("unpadded", "pads"), [(True, False), (False, True)])
def test_a_slot_pads_as_its_runner_does(tiny_model: Path, unpadded: bool, pads: bool) -> None:
    spec = ModelSpec(tiny_model, "1", device="cpu", unpadded=unpadded, warmup=False)
    handler = load_handler(spec)
    try:
        slot = ModelSlot(handler, spec, 0.0)
        assert slot.capabilities is handler.runner.capabilities  # type: ignore[attr-defined]
        assert slot.capabilities.pads is pads
    finally:
        handler.close()


def test_a_handler_without_a_runner_is_taken_to_pad(tmp_path: Path) -> None:
    handler = opened(HashHandler(), ModelSpec(tmp_path, "1"))
    assert ModelSlot(handler, ModelSpec(tmp_path, "1"), 0.0).capabilities == Capabilities()
    assert Capabilities().pads is True and not Capabilities().can_use_all_threads and not Capabilities().stages
