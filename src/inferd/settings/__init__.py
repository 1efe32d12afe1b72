"""The settings' schema: every section, its keys, their types, defaults and bounds, and the rules across keys.

One frozen Settings object (built by config.load_settings from the YAML layers, the environment and flags);
what a key means and which values it takes is declared here, once, and every reader takes it from here:
``from inferd.settings import ...``.

One module per group of sections: base (the enumerations, the section base), server (with its tenants),
model (with its gate, chunking and canary), engine (limits, batching, runtime, memory, cache, shadow),
jobs, fleet, and whole (Settings itself, the served models, the rules across sections).
"""

from __future__ import annotations

from inferd.settings.base import (
    AUTO_CANDIDATES,
    BACKENDS,
    DTYPES,
    LOAD_MODES,
    LOG_FORMATS,
    LOG_LEVELS,
    PLATFORMS,
    QUANTIZE,
    UNPADDED,
    AutoCandidate,
    Backend,
    Docs,
    Dtype,
    LoadMode,
    LogFormat,
    LogLevel,
    Platform,
    Quantize,
)
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
from inferd.settings.model import CanarySettings, ChunkingSettings, GateSettings, ModelSettings, resolve_model_path
from inferd.settings.server import KEY_HASH, TENANT_NAME, ServerSettings, TenantSettings, check_tenants, key_digest
from inferd.settings.whole import MODEL_NAME, ModelEntry, Settings, check_tenant_rules, env_name

__all__ = [
    "AUTO_CANDIDATES", "AutoCandidate",
    "BACKENDS", "Backend", "BatchingSettings", "CacheSettings", "CanarySettings", "ChunkingSettings", "DTYPES",
    "Docs", "Dtype", "FleetSettings", "GateSettings", "JobsSettings", "KEY_HASH", "LOAD_MODES", "LOG_FORMATS",
    "LOG_LEVELS", "LimitSettings", "LoadMode", "LogFormat", "LogLevel", "MODEL_NAME", "MemorySettings",
    "ModelEntry", "ModelSettings", "PLATFORMS", "Platform", "QUANTIZE", "Quantize", "RuntimeSettings",
    "ServerSettings", "Settings", "ShadowSettings", "TENANT_NAME", "TenantSettings", "UNPADDED",
    "check_tenant_rules", "check_tenants", "env_name", "key_digest", "resolve_model_path",
]
