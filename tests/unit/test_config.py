"""Settings: the layer order, env parsing, and validation messages that name the key and where it came from."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from inferd.config import ConfigError, load_settings
from inferd.settings import Settings, resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def write_configs(folder: Path, base: str = "", dev: str = "", **overlays: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.yaml").write_text(base, encoding="utf-8")
    (folder / "dev.yaml").write_text(dev, encoding="utf-8")
    for name, text in overlays.items():
        (folder / f"{name}.yaml").write_text(text, encoding="utf-8")
    return folder


def error_of(**kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**kw)
    return str(info.value)


# -- layer order: base < overlay < MODEL_PATH < INFERD__ env < flags -----------------------------------------


@pytest.fixture
def layered(tmp_path: Path) -> Path:
    return write_configs(
        tmp_path / "cfg",
        base="model:\n  path: /from/base\n  version: base\nserver:\n  port: 1111\n  host: 10.0.0.1\n",
        dev="model:\n  path: /from/overlay\nserver:\n  port: 2222\n")


@pytest.mark.parametrize(("environ", "overrides", "expected"), [
    ({}, {}, "/from/overlay"),
    ({"MODEL_PATH": "/from/short-env"}, {}, "/from/short-env"),
    ({"MODEL_PATH": "/from/short-env", "INFERD__MODEL__PATH": "/from/env"}, {}, "/from/env"),
    ({"MODEL_PATH": "/from/short-env", "INFERD__MODEL__PATH": "/from/env"}, {"model.path": "/from/flag"},
     "/from/flag"),
])
def test_each_layer_overrides_the_one_below(layered: Path, environ: dict, overrides: dict, expected: str) -> None:
    settings = load_settings("dev", overrides, environ=environ, config_dir=layered)
    assert settings.model.path == expected


def test_overlay_deep_merges_and_keeps_base_siblings(layered: Path) -> None:
    settings = load_settings("dev", environ={}, config_dir=layered)
    assert settings.server.port == 2222          # overlay wins
    assert settings.server.host == "10.0.0.1"    # sibling in the same section survives the merge
    assert settings.model.version == "base"


def test_a_none_flag_leaves_the_lower_layers_alone(layered: Path) -> None:
    settings = load_settings("dev", {"server.port": None}, environ={"INFERD__SERVER__PORT": "3333"},
                             config_dir=layered)
    assert settings.server.port == 3333


def test_inferd_env_picks_the_overlay(tmp_path: Path) -> None:
    cfg = write_configs(tmp_path / "cfg", base="server:\n  port: 1\n", staging="server:\n  port: 2\n")
    assert load_settings(environ={"INFERD_ENV": "staging"}, config_dir=cfg).server.port == 2
    assert load_settings(environ={}, config_dir=cfg).env == "dev"


def test_real_overlays_are_valid_and_differ() -> None:
    dev = load_settings("dev", environ={}, config_dir=CONFIGS)
    prod = load_settings("prod", environ={}, config_dir=CONFIGS)
    assert (dev.server.log_format, prod.server.log_format) == ("text", "json")
    assert prod.server.host == "0.0.0.0"
    assert dev.model.load_mode == "background"


def test_settings_are_frozen() -> None:
    settings = load_settings("dev", environ={}, config_dir=CONFIGS)
    with pytest.raises(ValidationError):
        settings.server.port = 1  # type: ignore[misc]


# -- environment values -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "raw", "section", "key", "expected"), [
    ("INFERD__SERVER__PORT", "9001", "server", "port", 9001),
    ("INFERD__MODEL__TRUNCATE", "false", "model", "truncate", False),
    ("INFERD__BATCHING__MAX_WAIT_MS", "0.5", "batching", "max_wait_ms", 0.5),
    ("INFERD__SERVER__API_KEYS", "k1, k2,k3", "server", "api_keys", ("k1", "k2", "k3")),
    ("INFERD__SERVER__API_KEYS", "solo", "server", "api_keys", ("solo",)),
    ("INFERD__SERVER__API_KEYS", "[a, b]", "server", "api_keys", ("a", "b")),
    ("INFERD__SERVER__API_KEYS", "123,456", "server", "api_keys", ("123", "456")),
    ("INFERD__MODEL__ROOT", "/m1,/m2", "model", "root", ("/m1", "/m2")),
    # Text fields keep the variable as written, even when YAML would read a number or a boolean.
    ("INFERD__MODEL__VERSION", "2", "model", "version", "2"),
    ("INFERD__SERVER__ADMIN_KEY", "12345", "server", "admin_key", "12345"),
    ("INFERD__MODEL__NAME", "yes", "model", "name", "yes"),
    ("INFERD__SERVER__ADMIN_KEY", "null", "server", "admin_key", None),
    ("INFERD__MODEL__POOLING", "cls", "model", "pooling", "cls"),
])
def test_env_values_are_read_as_their_field_type(name: str, raw: str, section: str, key: str,
                                                 expected: object) -> None:
    settings = load_settings("dev", environ={name: raw}, config_dir=CONFIGS)
    assert getattr(getattr(settings, section), key) == expected


def test_env_names_are_case_insensitive_after_the_prefix() -> None:
    assert load_settings("dev", environ={"INFERD__server__Port": "7070"}, config_dir=CONFIGS).server.port == 7070


# -- validation messages: the key and its source ----------------------------------------------------------


def test_wrong_type_from_env_names_key_and_variable() -> None:
    msg = error_of(env="dev", environ={"INFERD__SERVER__PORT": "eighty"}, config_dir=CONFIGS)
    assert "server.port" in msg and "env INFERD__SERVER__PORT" in msg


def test_impossible_value_from_flag_names_the_flag() -> None:
    msg = error_of(env="dev", overrides={"server.port": 70000}, environ={}, config_dir=CONFIGS)
    assert "server.port" in msg and "flag --port" in msg and "65535" in msg


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    cfg = write_configs(tmp_path / "cfg", dev="server:\n  prot: 80\n")
    msg = error_of(env="dev", environ={}, config_dir=cfg)
    assert "server.prot: unknown key" in msg and str(cfg / "dev.yaml") in msg


def test_wrong_type_in_a_file_names_the_file(tmp_path: Path) -> None:
    cfg = write_configs(tmp_path / "cfg", base="limits:\n  max_items_per_request: many\n")
    msg = error_of(env="dev", environ={}, config_dir=cfg)
    assert "limits.max_items_per_request" in msg and str(cfg / "base.yaml") in msg


def test_unknown_key_from_env_names_the_variable() -> None:
    msg = error_of(env="dev", environ={"INFERD__SERVER__BOGUS": "1"}, config_dir=CONFIGS)
    assert "server.bogus: unknown key" in msg and "env INFERD__SERVER__BOGUS" in msg


def test_unknown_section_from_env_names_the_variable() -> None:
    msg = error_of(env="dev", environ={"INFERD__NOPE__X": "1"}, config_dir=CONFIGS)
    assert "nope: unknown key" in msg and "env INFERD__NOPE__X" in msg


def test_a_literal_names_its_choices() -> None:
    msg = error_of(env="dev", environ={"INFERD__MODEL__LOAD_MODE": "sometimes"}, config_dir=CONFIGS)
    assert "model.load_mode" in msg and "'lazy'" in msg and "env INFERD__MODEL__LOAD_MODE" in msg


def test_device_is_checked() -> None:
    msg = error_of(env="dev", environ={"INFERD__MODEL__DEVICE": "tpu"}, config_dir=CONFIGS)
    assert "model.device" in msg and "cuda:N" in msg


def test_cross_field_rule_names_the_section_and_the_variable() -> None:
    msg = error_of(env="dev", environ={"INFERD__BATCHING__MAX_QUEUE": "4"}, config_dir=CONFIGS)
    assert "batching" in msg and "max_queue must be at least" in msg
    assert "env INFERD__BATCHING__MAX_QUEUE" in msg


def test_every_error_is_listed_not_only_the_first() -> None:
    msg = error_of(env="dev", environ={"INFERD__SERVER__PORT": "x", "INFERD__MODEL__DTYPE": "int4"},
                   config_dir=CONFIGS)
    assert "server.port" in msg and "model.dtype" in msg


def test_a_missing_overlay_is_named(tmp_path: Path) -> None:
    cfg = write_configs(tmp_path / "cfg")
    msg = error_of(env="qa", environ={}, config_dir=cfg)
    assert "INFERD_ENV='qa'" in msg and "qa.yaml" in msg


@pytest.mark.parametrize(("text", "needle"), [("server: [unclosed\n", "not valid YAML"),
                                              ("- a list\n", "mapping at the top level")])
def test_broken_files_are_named(tmp_path: Path, text: str, needle: str) -> None:
    cfg = write_configs(tmp_path / "cfg", base=text)
    msg = error_of(env="dev", environ={}, config_dir=cfg)
    assert needle in msg and str(cfg / "base.yaml") in msg


def test_env_var_with_no_key_is_refused() -> None:
    assert "names no configuration key" in error_of(env="dev", environ={"INFERD__": "1"}, config_dir=CONFIGS)


# -- the model path -----------------------------------------------------------------------------------------


def test_default_model_path_is_the_packaged_minilm() -> None:
    path = resolve_model_path(Settings().model)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def test_explicit_model_path_expands_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = load_settings("dev", environ={"MODEL_PATH": "~/models/x"}, config_dir=CONFIGS)
    assert resolve_model_path(settings.model) == tmp_path / "models" / "x"
