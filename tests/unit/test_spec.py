"""ModelSpec: the model settings plus the path and version of one load, not a second list of the settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from inferd.core.backends.base import options_for
from inferd.core.spec import ModelSpec, spec_from_settings
from inferd.settings import ModelSettings, Settings


def test_a_spec_reads_the_model_settings_from_the_settings_it_holds(tmp_path: Path) -> None:
    model = ModelSettings(path=str(tmp_path), version="7", device="cpu", pooling="cls", backend="openvino",
                          max_seq_length=64, unpadded=False, truncate=False, allow_pickle=True)
    spec = spec_from_settings(Settings(model=model))
    assert (spec.path, spec.version, spec.settings) == (tmp_path, "7", model)
    # What every load reads is a declared property of the spec (no __getattr__ forwarding: a misspelt name is
    # an AttributeError here and a type error for mypy), each the setting's own value.
    declared = [n for n, v in vars(ModelSpec).items() if isinstance(v, property)]
    assert {"name", "device", "backend", "dtype", "quantize", "unpadded", "gate", "pooling", "normalize",
            "max_seq_length", "truncate", "warmup", "allow_pickle", "task"} <= set(declared)
    for name in declared:
        assert getattr(spec, name) == getattr(model, name), name
    assert not hasattr(spec, "memory_fraction")  # the rest: spec.settings.memory_fraction
    # A reload brings its own folder and version; the rest stays the configuration's.
    other = spec_from_settings(Settings(model=model), tmp_path / "b", "8")
    assert (other.path, other.version, other.pooling) == (tmp_path / "b", "8", "cls")


def test_keyword_overrides_are_validated_as_the_configuration_is(tmp_path: Path) -> None:
    spec = ModelSpec(tmp_path, "1", device="cpu", warmup=False, gate=(("int8_cosine_min", 1.0),))
    assert (spec.device, spec.warmup, spec.task) == ("cpu", False, "auto")
    assert options_for(spec).gate.int8_cosine_min == 1.0
    with pytest.raises(ValidationError):
        ModelSpec(tmp_path, "1", dtype="float8")
    with pytest.raises(AttributeError):
        _ = spec.no_such_setting
