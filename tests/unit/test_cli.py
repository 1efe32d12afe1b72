"""The CLI maps flags onto Settings and calls ``run(settings)``; tested with run mocked, as uvicorn does."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

from inferd import cli
from inferd.config_flags import FLAGS
from inferd.settings import Settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI reads the real environment; start every test from the files alone.
    for name in list(os.environ):
        if name.startswith("INFERD") or name == "MODEL_PATH":
            monkeypatch.delenv(name)
    monkeypatch.setenv("INFERD_CONFIG_DIR", str(CONFIGS))


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    calls: list[Settings] = []

    def fake_run(settings: Settings) -> int:
        calls.append(settings)
        return 7

    monkeypatch.setattr(cli, "start_server", fake_run)
    return calls


def check_config(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert cli.main(["check-config", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_serve_passes_the_effective_settings_to_start_server(ran: list[Settings]) -> None:
    rc = cli.main(["serve", "--port", "9123", "--load-mode", "lazy", "--model-path", "/m", "--dtype", "bfloat16"])
    assert rc == 7  # start_server's return value is the exit status
    (settings,) = ran
    assert settings.server.port == 9123
    assert settings.model.load_mode == "lazy"
    assert settings.model.path == "/m"
    assert settings.model.dtype == "bfloat16"


# One value per flag, and where it must land: a flag wired to the wrong key fails here.
FLAG_VALUES = {
    "host": ("0.0.0.0", "0.0.0.0"), "port": ("9001", 9001), "admin_port": ("9002", 9002),
    "log_format": ("json", "json"), "log_level": ("ERROR", "ERROR"), "model_path": ("/some/model", "/some/model"),
    "model_version": ("v9", "v9"), "load_mode": ("eager", "eager"), "device": ("cpu", "cpu"),
    "dtype": ("float16", "float16"), "max_batch_size": ("7", 7), "max_wait_ms": ("0.25", 0.25),
    "torch_threads": ("3", 3), "backend": ("openvino", "openvino"), "quantize": ("int8", "int8"),
    "cache_dir": ("/c", "/c"), "calibration_file": ("/cal.txt", "/cal.txt"), "platform": ("vertex", "vertex"),
}


def test_every_flag_is_covered() -> None:
    assert set(FLAG_VALUES) == set(FLAGS)


@pytest.mark.parametrize("flag", sorted(FLAG_VALUES))
def test_each_flag_lands_on_its_key(ran: list[Settings], flag: str) -> None:
    raw, expected = FLAG_VALUES[flag]
    assert cli.main(["serve", f"--{flag.replace('_', '-')}", raw]) == 7
    section, key = FLAGS[flag].split(".")
    assert getattr(getattr(ran[0], section), key) == expected


def test_flags_beat_environment(ran: list[Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD__SERVER__PORT", "1000")
    monkeypatch.setenv("INFERD__BATCHING__MAX_BATCH_SIZE", "5")
    cli.main(["serve", "--port", "2000"])
    assert ran[0].server.port == 2000                # flag wins
    assert ran[0].batching.max_batch_size == 5       # env still applies where no flag was given


def test_env_flag_picks_the_overlay(ran: list[Settings]) -> None:
    cli.main(["serve", "--env", "prod"])
    assert ran[0].env == "prod" and ran[0].server.log_format == "json"


def test_config_dir_flag(ran: list[Settings], tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("server:\n  port: 4321\n")
    (tmp_path / "dev.yaml").write_text("")
    cli.main(["serve", "--config-dir", str(tmp_path)])
    assert ran[0].server.port == 4321


def test_invalid_configuration_exits_2_without_serving(ran: list[Settings], monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("INFERD__MODEL__PATHH", "/x")
    assert cli.main(["serve"]) == 2
    assert ran == []
    err = capsys.readouterr().err
    assert "model.pathh: unknown key" in err and "env INFERD__MODEL__PATHH" in err


def test_bad_flag_choice_is_an_argparse_error(ran: list[Settings]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--load-mode", "later"])
    assert info.value.code == 2 and ran == []


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_check_config_prints_the_effective_configuration(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD__LIMITS__MAX_ITEMS_PER_REQUEST", "12")
    monkeypatch.setenv("MODEL_PATH", "/models/minilm")
    data = check_config(capsys, "--port", "8111")
    assert data["env"] == "dev"
    assert data["server"]["port"] == 8111
    assert data["server"]["log_level"] == "DEBUG"                 # from dev.yaml over base.yaml
    assert data["limits"]["max_items_per_request"] == 12
    assert data["model"]["path"] == "/models/minilm"
    # Every section is there, in a form Settings accepts back.
    Settings.model_validate(data)


def test_check_config_redacts_secrets(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD__SERVER__API_KEYS", "sk-one,sk-two")
    monkeypatch.setenv("INFERD__SERVER__ADMIN_KEY", "adm-secret")
    assert cli.main(["check-config"]) == 0
    out = capsys.readouterr().out
    assert "sk-one" not in out and "adm-secret" not in out
    data = yaml.safe_load(out)
    assert data["server"]["api_keys"] == "***" and data["server"]["admin_key"] == "***"
    assert data["server"]["metrics_key"] is None  # unset secrets stay visibly unset


def test_check_config_reports_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD__SERVER__PORT", "not-a-port")
    assert cli.main(["check-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "server.port" in captured.err and "env INFERD__SERVER__PORT" in captured.err


def test_set_reaches_any_key_and_one_model_of_a_list(ran: list[Settings], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "configs"
    config.mkdir()
    (config / "base.yaml").write_text((CONFIGS / "base.yaml").read_text())
    (config / "dev.yaml").write_text("models:\n  - {name: embedder, path: /m/e}\n  - {name: bge-v1.5, path: /m/r}\n")
    monkeypatch.setenv("INFERD_CONFIG_DIR", str(config))
    assert cli.main(["serve", "--set", "models.bge-v1.5.backend=openvino", "--set", "models.bge-v1.5.version=2",
                     "--set", "batching.max_wait_ms=7", "--set", "models.embedder.batching.max_batch_size=4"]) == 7
    embedder, reranker = ran[0].served()
    assert (reranker.model.backend, reranker.model.version, embedder.model.backend) == ("openvino", "2", "torch")
    assert (embedder.batching.max_batch_size, reranker.batching.max_batch_size) == (4, 32)
    assert embedder.batching.max_wait_ms == reranker.batching.max_wait_ms == 7.0
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        cli.main(["serve", "--set", "batching.max_wait_ms"])
    assert cli.main(["check-config", "--set", "models.nope.backend=onnx"]) != 0


def test_the_cli_and_the_fleets_commands_start_without_torch() -> None:
    """`inferd fleet status`, `fleet shadow report`, `check-config` need no model runtime: importing torch costs
    each call about 3 s on a small machine (it crept in once through the shadow report's rank figures)."""
    import subprocess
    import sys

    code = ("import sys, inferd.cli, inferd.fleet.command, inferd.fleet.shadow, inferd.core.shadow; "
            "heavy = sorted(m for m in ('torch', 'transformers', 'onnxruntime', 'openvino') if m in sys.modules); "
            "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_check_config_refuses_a_tenants_file_the_server_would_refuse(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One key in two tenants (itself and its hash), or a model not served: refused before a start would fail."""
    path = tmp_path / "tenants.yaml"
    monkeypatch.setenv("INFERD__SERVER__TENANTS_FILE", str(path))
    hashed = "sha256:" + hashlib.sha256(b"k1").hexdigest().upper()
    for tenants, says in (([{"name": "nu", "keys": ["k1"]}, {"name": "xi", "keys": [hashed]}], "another tenant's"),
                          ([{"name": "nu", "keys": ["k1"], "models": ["nope"]}], "not served")):
        path.write_text(yaml.safe_dump({"tenants": tenants}))
        assert cli.main(["check-config"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and says in captured.err and "k1" not in captured.err


def test_check_config_redacts_every_tenant_s_keys() -> None:
    settings = Settings.model_validate({"server": {"tenants": [{"name": "a", "keys": ["sk-tenant-a", "sk-a2"]}]}})
    data = cli.redacted(settings)
    assert data["server"]["tenants"][0]["keys"] == ["***", "***"] and "sk-tenant" not in str(data)


def test_an_unknown_auto_candidate_is_refused_with_the_configuration(
        ran: list[Settings], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at start, as any bad key is: the background judging, where it was found before, lost it, and the
    server stayed on torch without a word."""
    monkeypatch.setenv("INFERD__MODEL__AUTO_CANDIDATES", "[openvino-foo]")
    assert cli.main(["check-config"]) == 2
    assert cli.main(["serve", "--backend", "auto"]) == 2 and ran == []
    err = capsys.readouterr().err
    assert "model.auto_candidates" in err and "'openvino-float32'" in err
    assert "env INFERD__MODEL__AUTO_CANDIDATES" in err


@pytest.mark.parametrize("command", ["prepare", "export"])
def test_prepare_and_export_log_as_their_flags_say(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    configured: list[tuple[str, str]] = []
    monkeypatch.setattr(cli, "configure_logging", lambda level, fmt: configured.append((level, fmt)))
    monkeypatch.setattr("inferd.prepare.prepare", lambda settings: 0)
    monkeypatch.setattr(cli, "export", lambda settings: 0)
    assert cli.main([command, "--log-level", "DEBUG", "--log-format", "json"]) == 0
    assert configured == [("DEBUG", "json")]
