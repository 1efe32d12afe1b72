"""Fleet fixtures (helpers in fleetkit.py): every fleet a test starts is stopped and checked for leftovers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .fleetkit import Fleet, finish, start_fleet


@pytest.fixture
def fleet_factory(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[..., Fleet]]:
    started: list[Fleet] = []

    def make(env: dict[str, str] | None = None, args: list[str] | None = None, wait: bool = True) -> Fleet:
        folder = tmp_path / f"fleet{len(started)}"
        folder.mkdir()
        fleet = start_fleet(folder, tiny_model, env, args, wait)
        started.append(fleet)
        return fleet

    yield make
    for fleet in started:
        finish(fleet)
