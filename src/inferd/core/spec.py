"""What to load: a model's settings, with the folder and version one load uses (a reload or a canary
brings its own path and version; every other ``model.*`` setting is the configuration's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.config import ModelSettings, Settings, resolve_model_path


@dataclass(frozen=True, init=False)
class ModelSpec:
    """The resolved ``path`` and ``version``, and the ``ModelSettings`` they go with.

    The settings are declared once, in config.py: ``spec.device``, ``spec.backend``, ``spec.pooling`` and
    every other ``model.*`` key are read from ``spec.settings``. Keyword arguments override settings by
    name (``ModelSpec(path, "1", device="cpu", warmup=False)``), validated as the configuration would be.
    """

    path: Path
    version: str
    settings: ModelSettings

    def __init__(self, path: Path, version: str | None = None, settings: ModelSettings | None = None,
                 **overrides: Any) -> None:
        base = settings if settings is not None else ModelSettings()
        if overrides:
            if "gate" in overrides and not isinstance(overrides["gate"], dict):
                overrides["gate"] = dict(overrides["gate"])  # pairs or a GateSettings: its fields by name
            base = ModelSettings.model_validate({**base.model_dump(), **overrides})
        object.__setattr__(self, "path", Path(path))
        object.__setattr__(self, "version", version if version is not None else base.version)
        object.__setattr__(self, "settings", base)

    def __getattr__(self, name: str) -> Any:
        # Only for names the dataclass does not hold; guarded so copying or unpickling cannot recurse.
        if name.startswith("__") or name == "settings":
            raise AttributeError(name)
        return getattr(self.settings, name)


def spec_from_settings(settings: Settings, path: Path | None = None, version: str | None = None) -> ModelSpec:
    m = settings.model
    return ModelSpec(path or resolve_model_path(m), version or m.version, m)
