"""``inferd fleet`` on the command line: flags onto Settings (run mocked), and how the actions find a fleet."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from inferd import cli
from inferd.fleet import command, control
from inferd.settings import Settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("INFERD") or name == "MODEL_PATH":
            monkeypatch.delenv(name)
    monkeypatch.setenv("INFERD_CONFIG_DIR", str(CONFIGS))


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Settings, Path | None, bool]]:
    calls: list[tuple[Settings, Path | None, bool]] = []

    def fake(settings: Settings, run_dir: Path | None, print_only: bool) -> int:
        calls.append((settings, run_dir, print_only))
        return 5

    import inferd.fleet.runner as runner

    monkeypatch.setattr(runner, "run_fleet", fake)
    return calls


def test_fleet_flags_land_on_the_fleet_and_the_workers_settings(ran: list, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD__BATCHING__MAX_BATCH_SIZE", "7")
    rc = cli.main(["fleet", "--workers", "3", "--port", "9000", "--host", "10.1.2.3", "--run-dir", str(tmp_path),
                   "--model-path", "/m", "--model-version", "v9", "--torch-threads", "2", "--max-wait-ms", "4",
                   "--env", "prod", "--print-config"])
    assert rc == 5
    ((settings, run_dir, print_only),) = ran
    assert (settings.fleet.workers, settings.fleet.port, settings.fleet.host) == (3, 9000, "10.1.2.3")
    assert settings.server.port == 8000 and settings.server.host == "0.0.0.0"  # prod's own: --port is nginx's
    assert (settings.model.path, settings.model.version, settings.runtime.torch_threads) == ("/m", "v9", 2)
    assert settings.batching.max_wait_ms == 4 and settings.batching.max_batch_size == 7  # env passes through too
    assert settings.env == "prod" and run_dir == tmp_path and print_only


def test_workers_have_no_admin_port_flag_here() -> None:
    with pytest.raises(SystemExit):
        cli.main(["fleet", "--admin-port", "9001"])


def test_actions_need_a_running_fleet(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["fleet", "status", "--port", "1"]) == 2
    assert "no fleet is running on port 1" in capsys.readouterr().err
    assert cli.main(["fleet", "reload", "--run-dir", str(tmp_path), "--path", "/m", "--version", "2"]) == 2
    assert "not a fleet's run folder" in capsys.readouterr().err


def test_the_run_dir_is_found_by_flag_env_or_the_fleets_pointer(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "layout.json").write_text("{}")
    assert control.find_run_dir(tmp_path, 1) == tmp_path
    monkeypatch.setenv("INFERD_FLEET_RUN_DIR", str(tmp_path))
    assert control.find_run_dir(None, 1) == tmp_path
    monkeypatch.delenv("INFERD_FLEET_RUN_DIR")
    monkeypatch.setattr(control.tempfile, "gettempdir", lambda: str(tmp_path))
    control.pointer_path(8123).write_text(json.dumps({"run_dir": str(tmp_path), "pid": os.getpid()}))
    assert control.find_run_dir(None, 8123) == tmp_path
    control.pointer_path(8124).write_text(json.dumps({"run_dir": str(tmp_path), "pid": 2**22 + 12345}))
    with pytest.raises(control.FleetNotFound, match="stale"):
        control.find_run_dir(None, 8124)


@pytest.mark.parametrize("argv", [["fleet", "--run-dir", "/x", "status"], ["fleet", "status", "--run-dir", "/x"]])
def test_run_dir_is_accepted_before_or_after_the_action(argv: list[str]) -> None:
    args = cli.build_parser().parse_args(argv)
    assert args.action == "status" and args.run_dir == Path("/x")


def test_the_default_port_to_look_for_comes_from_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setenv("INFERD__FLEET__PORT", "8555")
    monkeypatch.setattr(command, "find_run_dir", lambda run_dir, port: seen.append(port) or Path("/nowhere"))
    args = argparse.Namespace(port=None, run_dir=None, env=None, config_dir=None)
    command._run_dir(args)
    assert seen == [8555]
