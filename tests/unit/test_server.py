"""inferd.server alone: a SIGHUP reload that cannot read its configuration or changes what only a restart applies,
and the shutdown watchdog."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from conftest import metric_value
from enginekit import EngineKit
from fakes import HashHandler
from prometheus_client import generate_latest
from settingskit import make_settings

from inferd import server as server_mod
from inferd.server import DrainingServer, reload_from_config
from inferd.settings import Settings
from inferd.utils.metrics import Metrics


class NeverCalled:
    def reload_from_settings(self, fresh: Settings) -> Any:
        raise AssertionError("nothing may be reloaded from a configuration that could not be read")


def failed_reloads(metrics: Metrics) -> float:
    return metric_value(generate_latest(metrics.registry).decode(), "inferd_model_reloads_total", outcome="failed")


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied", "/etc/inferd/base.yaml"),
                                   IsADirectoryError(21, "Is a directory", "/etc/inferd/dev.yaml"),
                                   RuntimeError("something nobody foresaw")])
def test_a_sighup_whose_configuration_cannot_be_read_is_a_failed_reload_not_an_unhandled_task(
        error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 8, item 9: on main a PermissionError escaped reload_from_config into a task nobody awaited.
    metrics = Metrics(8)

    def reread() -> Settings:
        raise error

    with caplog.at_level(logging.ERROR, logger="inferd.server"):
        outcome = asyncio.run(reload_from_config(NeverCalled(), metrics, reread))
    assert outcome == "failed"
    assert failed_reloads(metrics) == 1
    assert any("SIGHUP reload failed" in r.getMessage() for r in caplog.records)


def test_a_sighup_names_in_one_warning_every_change_only_a_restart_applies(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The probe's: such changes logged only "SIGHUP: <model> unchanged", load_mode taken as if applied.
    kit = EngineKit(make_settings(tmp_path), HashHandler())
    fresh = make_settings(tmp_path, server={"port": 9001, "log_level": "DEBUG", "log_format": "json",
                                            "api_keys": ["k1"]},
                          limits={"max_items_per_request": 8}, model={"load_mode": "lazy"},
                          batching={"max_batch_size": 4})
    with caplog.at_level(logging.INFO, logger="inferd.server"):
        outcome = kit.run(lambda: reload_from_config(kit.engine, kit.metrics, lambda: fresh))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # The tenants' keys (server.api_keys) and the model's batching are applied: not named.
    assert warnings == ["SIGHUP: server.port, server.log_level, server.log_format, limits.max_items_per_request, "
                        "model.load_mode change only at a restart"]
    assert outcome == "ok" and kit.engine.limits.max_items == 256
    served = kit.engine.registry.first()
    assert served is not None and served.settings.model.load_mode == "eager"
    assert served.entry.batching.max_batch_size == 4 and served.settings.limits.max_items_per_request == 256


def test_the_watchdog_ends_a_shutdown_that_overruns_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    exited = threading.Event()
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    monkeypatch.setattr(server_mod.os, "_exit", fake_exit)
    monkeypatch.setattr(server_mod, "SHUTDOWN_MARGIN_S", 0.6)  # fires at drain + margin - 0.5 s

    async def drain() -> bool:
        return True

    srv = DrainingServer(uvicorn.Config(app=None), drain, drain_timeout_s=0.1)
    srv.handle_exit(15, None)  # no loop yet: it stops at once, and the watchdog is armed all the same
    assert srv.should_exit and srv.watchdog is not None
    srv.handle_exit(15, None)
    assert exited.wait(5)
    assert codes == [0]


def test_the_watchdog_exits_even_when_a_log_stream_is_closed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Its flush of the log handlers raised on a closed stream, and the process did not exit (seen in CI)."""
    codes: list[int] = []
    monkeypatch.setattr(server_mod.os, "_exit", codes.append)
    closed = (tmp_path / "log").open("w")
    closed.close()
    handler = logging.StreamHandler(closed)
    handler.handleError = lambda record: None  # type: ignore[method-assign]  # the error line's own write
    inferd_log = logging.getLogger("inferd")
    inferd_log.addHandler(handler)
    try:
        server_mod._overran(0.1)
    finally:
        inferd_log.removeHandler(handler)
    assert codes == [0]
