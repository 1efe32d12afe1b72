"""The whole settings: every section, the served models (``models:``) and the rules across them."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, model_validator

from inferd.settings.base import Section
from inferd.settings.engine import (
    BatchingSettings,
    CacheSettings,
    LimitSettings,
    MemorySettings,
    RuntimeSettings,
    ShadowSettings,
)
from inferd.settings.fleet import FleetSettings
from inferd.settings.jobs import JobsSettings
from inferd.settings.model import CanarySettings, ModelSettings
from inferd.settings.server import ServerSettings, TenantSettings

# A served model's name, as clients send it in ``model``: OpenAI's ids (letters, digits, - _ . : /), no spaces,
# no "@" (``name@version`` pins a version).
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class ModelEntry(Section):
    """One served model: its model settings (``model:`` is every entry's defaults) and its own batching
    rules, result cache and canary. Built by load_settings from a ``models:`` entry, or from the ``model:``
    block alone (a list of one)."""

    name: str = Field(pattern=MODEL_NAME)
    model: ModelSettings = ModelSettings()
    batching: BatchingSettings = BatchingSettings()
    cache: CacheSettings = CacheSettings()
    canary: CanarySettings = CanarySettings()
    # /health/ready answers 200 only when every required model is ready.
    required: bool = True
    # The model a route of its task runs when a request names none (else the task's first model).
    default: bool = False
    # Its share of the device when several models have work queued (the scheduler's weight, core/lanes.py).
    share: float = Field(1.0, gt=0.0, le=100.0)
    # More names clients may send as ``model`` for it (OpenAI's ``text-embedding-3-small`` served by a local
    # embedder, so code written for OpenAI changes only its base URL); /v1/models lists them.
    aliases: tuple[Annotated[str, Field(pattern=MODEL_NAME)], ...] = ()


def env_name(name: str) -> str:
    """A model's name as an environment variable spells it: INFERD__MODELS__<this>__KEY (case-insensitive)."""
    return re.sub(r"[^a-z0-9]", "_", name.lower())


class Settings(Section):
    env: str = "dev"
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    canary: CanarySettings = CanarySettings()
    limits: LimitSettings = LimitSettings()
    batching: BatchingSettings = BatchingSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    memory: MemorySettings = MemorySettings()
    cache: CacheSettings = CacheSettings()
    shadow: ShadowSettings = ShadowSettings()
    fleet: FleetSettings = FleetSettings()
    jobs: JobsSettings = JobsSettings()
    # Every served model, in order; empty = the ``model:`` block alone (``served`` builds the list of one).
    models: tuple[ModelEntry, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> Settings:
        seen: dict[str, str] = {}
        for entry in self.models:
            key = env_name(entry.name)
            if key in seen:
                raise ValueError(f"models: the names {seen[key]!r} and {entry.name!r} are one model to clients or "
                                 "to environment variables (case, and - . : / as _); give each its own name")
            seen[key] = entry.name
        names = {e.name for e in self.models}
        aliases: dict[str, str] = {}
        for entry in self.models:
            for alias in entry.aliases:
                if alias in names or alias in aliases:
                    raise ValueError(f"models: {alias!r}, an alias of {entry.name!r}, is already a served model's "
                                     "name or alias: a request naming it would run either")
                aliases[alias] = entry.name
        fractions = [e.model.memory_fraction for e in self.models if e.model.memory_fraction is not None]
        limit = self.memory.per_process_fraction or 1.0
        if sum(fractions) > limit + 1e-9:
            raise ValueError(f"models: the models' memory_fraction add up to {sum(fractions):g}, more than the "
                             f"process may use ({limit:g}: memory.per_process_fraction, or the whole device)")
        for task_defaults in _defaults_by_task(self.models).values():
            if len(task_defaults) > 1:
                raise ValueError(f"models: {', '.join(task_defaults)} are all marked default; one per task")
        check_tenant_rules(self.server.tenants, self)
        return self

    def served(self) -> tuple[ModelEntry, ...]:
        """The models this server serves: the ``models:`` list, or the ``model:`` block as a list of one."""
        if self.models:
            return self.models
        return (ModelEntry(name=self.model.name, model=self.model, batching=self.batching, cache=self.cache,
                           canary=self.canary),)

    def model_names(self) -> dict[str, str]:
        """Every name a request may call a served model by (its own, and its aliases), to the model's own name."""
        return {name: e.name for e in self.served() for name in (e.name, *e.aliases)}

    def for_model(self, entry: ModelEntry) -> Settings:
        """These settings as one model sees them: its model, batching, cache and canary in the sections'
        places (what a single-model server reads), everything else shared."""
        return self.model_copy(update={"model": entry.model, "batching": entry.batching, "cache": entry.cache,
                                       "canary": entry.canary, "models": (entry,)})


def check_tenant_rules(tenants: tuple[TenantSettings, ...], settings: Settings) -> None:
    """What a tenant names must be served: each of its ``models`` a served model or an alias of one (a name of
    neither would refuse its every request), and its ``default_priority`` at most every model it may call allows
    (``batching.max_priority``: a request's own priority is held to it, so a default is too)."""
    names = settings.model_names()
    entries = {e.name: e for e in settings.served()}
    for tenant in tenants:
        unknown = [m for m in tenant.models if m not in names]
        if unknown:
            raise ValueError(f"tenant {tenant.name!r}: models {unknown} are not served here (served: "
                             f"{sorted(names)}); each is a served model's name or alias")
        for name in sorted({names[m] for m in tenant.models} or entries):
            ceiling = entries[name].batching.max_priority
            if tenant.default_priority > ceiling:
                raise ValueError(f"tenant {tenant.name!r}: default_priority {tenant.default_priority} is above "
                                 f"{ceiling}, the highest model {name!r} runs a request at (batching.max_priority)")


def _defaults_by_task(entries: tuple[ModelEntry, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in entries:
        if e.default:
            out.setdefault(e.model.task, []).append(e.name)
    return out
