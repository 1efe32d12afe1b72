"""What to load: a model's settings, with the folder and version one load uses (a reload or a canary
brings its own path and version; every other ``model.*`` setting is the configuration's), the roots every file
of the load must stay under, and the text limit the model's own prompts must fit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from inferd.settings import (
    Backend,
    Dtype,
    GateSettings,
    LimitSettings,
    ModelSettings,
    Quantize,
    Settings,
    resolve_model_path,
)

_MAX_CHARS = LimitSettings().max_chars_per_text
_MAX_TOKEN_VECTORS = LimitSettings().max_multivector_tokens


@dataclass(frozen=True, init=False)
class ModelSpec:
    """The resolved ``path`` and ``version``, and the ``ModelSettings`` they go with.

    ``files_roots``: the folders every file the load opens must resolve under, symlinks followed (the
    ``model.root`` entries; empty: ``path``'s parent, as when no ``model.root`` is set). ``max_chars_per_text``: the
    server's ``limits.max_chars_per_text``, which a prompt the model prepends to texts may not exceed.
    ``max_token_vectors``: ``limits.max_multivector_tokens``, which a multi-vector model checks a request's token
    counts against once tokenised, before it queues (core/tasks/base.py TokenVectorTask).

    The settings are declared once, in inferd.settings, and read from ``spec.settings``; those every load reads
    (``spec.device``, ``spec.backend``, ``spec.pooling``, ...) are properties of the spec too. Keyword arguments
    override settings by name (``ModelSpec(path, "1", device="cpu", warmup=False)``), validated as the
    configuration would be.
    """

    path: Path
    version: str
    settings: ModelSettings
    files_roots: tuple[Path, ...]
    max_chars_per_text: int
    max_token_vectors: int

    def __init__(self, path: Path, version: str | None = None, settings: ModelSettings | None = None,
                 files_roots: tuple[Path, ...] = (), max_chars_per_text: int = _MAX_CHARS,
                 max_token_vectors: int = _MAX_TOKEN_VECTORS, **overrides: Any) -> None:
        base = settings if settings is not None else ModelSettings()
        if overrides:
            if "gate" in overrides and not isinstance(overrides["gate"], dict):
                overrides["gate"] = dict(overrides["gate"])  # pairs or a GateSettings: its fields by name
            base = ModelSettings.model_validate({**base.model_dump(), **overrides})
        object.__setattr__(self, "path", Path(path))
        object.__setattr__(self, "version", version if version is not None else base.version)
        object.__setattr__(self, "settings", base)
        object.__setattr__(self, "files_roots", tuple(Path(r) for r in files_roots))
        object.__setattr__(self, "max_chars_per_text", max_chars_per_text)
        object.__setattr__(self, "max_token_vectors", max_token_vectors)

    # The settings a load reads, by name; every other ``model.*`` setting is read from ``spec.settings``.
    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def task(self) -> str:
        return self.settings.task

    @property
    def device(self) -> str:
        return self.settings.device

    @property
    def dtype(self) -> Dtype:
        return self.settings.dtype

    @property
    def backend(self) -> Backend:
        return self.settings.backend

    @property
    def quantize(self) -> Quantize:
        return self.settings.quantize

    @property
    def unpadded(self) -> bool | Literal["auto"]:
        return self.settings.unpadded

    @property
    def cache_dir(self) -> str | None:
        return self.settings.cache_dir

    @property
    def calibration_file(self) -> str | None:
        return self.settings.calibration_file

    @property
    def gate(self) -> GateSettings:
        return self.settings.gate

    @property
    def allow_pickle(self) -> bool:
        return self.settings.allow_pickle

    @property
    def pooling(self) -> str | None:
        return self.settings.pooling

    @property
    def normalize(self) -> bool | None:
        return self.settings.normalize

    @property
    def max_seq_length(self) -> int | None:
        return self.settings.max_seq_length

    @property
    def truncate(self) -> bool:
        return self.settings.truncate

    @property
    def warmup(self) -> bool:
        return self.settings.warmup

    @property
    def instances(self) -> int:
        return self.settings.instances

    @property
    def threads(self) -> int:
        return self.settings.threads


def spec_from_settings(settings: Settings, path: Path | None = None, version: str | None = None) -> ModelSpec:
    m = settings.model
    folder = path or resolve_model_path(m)
    return ModelSpec(folder, version or m.version, m, files_roots=roots_of(folder, settings),
                     max_chars_per_text=settings.limits.max_chars_per_text,
                     max_token_vectors=settings.limits.max_multivector_tokens)


def model_roots(settings: Settings) -> list[Path]:
    """The folders client loads may name (``model.root``; none set: the configured model's parent)."""
    roots = [Path(r).expanduser().resolve() for r in settings.model.root]
    return roots or [resolve_model_path(settings.model).expanduser().resolve().parent]


def roots_of(folder: Path, settings: Settings) -> tuple[Path, ...]:
    """The roots a load of ``folder`` is held to: every allowed root (a file linked from one to another is one
    a client could load anyway), and the folder's parent when it is the operator's own, outside them."""
    real = Path(folder).expanduser().resolve()
    roots = model_roots(settings)
    inside = any(r == real or r in real.parents for r in roots)
    return tuple(roots) if inside else (*roots, real.parent)
