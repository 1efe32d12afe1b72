"""settingskit.make_settings, the suites' one settings factory: what each of its promises means for a test."""

from __future__ import annotations

from pathlib import Path

import pytest
from settingskit import make_settings

from inferd.settings import BatchingSettings, ShadowSettings


def test_the_schema_s_defaults_under_the_quiet_ones_and_a_section_merges_over_them(tmp_path: Path) -> None:
    s = make_settings(tmp_path, batching={"max_batch_size": 4})
    assert (s.model.path, s.model.load_mode, s.model.warmup, s.model.device) == (str(tmp_path), "eager", False, "auto")
    assert (s.batching.max_wait_ms, s.batching.max_batch_size) == (0.0, 4)  # the quiet wait kept beside the change
    assert s.server.log_level == "INFO" and s.env == "dev"  # the schema's, not dev.yaml's
    assert make_settings(tmp_path, batching={}).batching.max_wait_ms == 0.0  # an empty section changes nothing


def test_overrides_apply_in_the_order_written_and_a_settings_object_is_taken_whole(tmp_path: Path) -> None:
    s = make_settings(tmp_path, model={"version": "v1", "gate": {"texts": 64}}, **{"model.version": "v2"})
    assert (s.model.version, s.model.gate.texts, s.model.gate.fp32_cosine_min) == ("v2", 64, 0.9999)
    assert make_settings(**{"model.version": "v2"}, model={"version": "v3"}).model.version == "v3"
    whole = make_settings(tmp_path, batching=BatchingSettings(max_batch_size=4))
    assert (whole.batching.max_batch_size, whole.batching.max_wait_ms) == (4, 2.0)  # its own wait, not the quiet one
    changed = make_settings(shadow=ShadowSettings(max_batch_size=4), **{"shadow.max_queue": 16})
    assert (changed.shadow.max_batch_size, changed.shadow.max_queue) == (4, 16)


def test_layered_reads_the_repository_s_files_and_none_of_the_quiet_defaults(tmp_path: Path) -> None:
    dev = make_settings(tmp_path, layered="dev", **{"batching.max_batch_size": 4})
    assert (dev.env, dev.server.log_level, dev.model.path) == ("dev", "DEBUG", str(tmp_path))  # dev.yaml's level
    assert (dev.model.load_mode, dev.model.warmup, dev.batching.max_wait_ms) == ("background", True, 2.0)
    assert dev.batching.max_batch_size == 4
    prod = make_settings(layered="prod")
    assert (prod.server.host, prod.server.log_format) == ("0.0.0.0", "json")  # prod.yaml's, not base.yaml's


def test_layered_never_reads_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD__SERVER__LOG_LEVEL", "ERROR")
    monkeypatch.setenv("MODEL_PATH", str(tmp_path / "from-env"))
    monkeypatch.setenv("INFERD_CONFIG_DIR", str(tmp_path / "no-configs-here"))
    monkeypatch.setenv("INFERD_ENV", "prod")
    s = make_settings(layered="dev")
    assert (s.env, s.server.log_level, s.model.path) == ("dev", "DEBUG", None)
    given = make_settings(layered="dev", environ={"INFERD__SERVER__LOG_LEVEL": "WARNING"})
    assert given.server.log_level == "WARNING"  # the environment a test passes is layered as the service does


def test_the_layers_options_are_refused_without_layers(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="layered"):
        make_settings(tmp_path, environ={"INFERD__SERVER__LOG_LEVEL": "ERROR"})
    with pytest.raises(TypeError, match="layered"):
        make_settings(tmp_path, config_dir=tmp_path)
