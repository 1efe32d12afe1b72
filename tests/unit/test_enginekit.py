"""tests/enginekit.py: the one in-process engine and the one async wait, and a scan that keeps them the only ones
(issue 40 item 5: the engine harness was built by hand in six suites and ``until`` written six times)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from enginekit import EngineKit, hold, until
from fakes import HashHandler, vector_for
from settingskit import make_settings

TESTS = Path(__file__).resolve().parents[1]
# A suite's own copy of the wait or of the engine's construction; the kit (and conftest's wait_for) are the places.
COPIES = {
    "an until of its own": (re.compile(r"^\s*(async\s+)?def until\b", re.M), {"enginekit.py"}),
    "a wait_for of its own": (re.compile(r"^\s*(async\s+)?def wait_for\b", re.M), {"conftest.py"}),
    "an engine built by hand": (re.compile(r"\bInferenceEngine\("), {"enginekit.py"}),
}


def test_no_suite_writes_its_own_until_wait_for_or_engine() -> None:
    found = [f"{path.relative_to(TESTS)}: {what}"
             for path in sorted(TESTS.rglob("*.py"))
             for what, (pattern, home) in COPIES.items()
             if path.name not in home and pattern.search(path.read_text(encoding="utf-8"))]
    assert found == [], "use tests/enginekit.py (EngineKit, until) or conftest.wait_for:\n" + "\n".join(found)


def test_until_returns_the_condition_s_value_awaits_a_coroutine_and_names_what_never_came() -> None:
    async def scenario() -> None:
        ticks = iter(range(5))
        assert await until(lambda: (n := next(ticks)) >= 3 and n) == 3

        async def over_http() -> str:
            return "ready"

        assert await until(over_http) == "ready"
        with pytest.raises(AssertionError, match="the impossible not reached within 0.05s"):
            await until(lambda: False, 0.05, "the impossible")

    asyncio.run(scenario())


def test_the_kit_loads_every_served_model_and_runs_its_engine_once(tmp_path: Path) -> None:
    handler = HashHandler()
    kit = EngineKit(make_settings(tmp_path), handler)
    assert kit.loaded == [handler] and kit.engine.manager.state == "ready"

    async def answered() -> list[float]:
        return (await kit.engine.process(kit.engine.request(["a"]))).outputs

    assert kit.run(answered) == [vector_for("a")]
    with pytest.raises(RuntimeError, match="build another EngineKit"):
        kit.run(answered)


def test_a_failing_scenario_leaves_no_worker_held(tmp_path: Path) -> None:
    handler = HashHandler()
    kit = EngineKit(make_settings(tmp_path), handler)

    async def fails_while_held() -> None:
        await hold(kit.engine, handler, "g")
        raise RuntimeError("the scenario failed")

    with pytest.raises(RuntimeError, match="the scenario failed"):
        kit.run(fails_while_held)
    # The held batch's gate was opened, so the engine's stop did not wait on it: its worker has finished.
    assert handler.gates["g"].is_set() and not kit.engine.alive
