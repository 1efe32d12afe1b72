"""The workers' configuration: the fleet's effective settings, written whole into the run folder's config/.

The workers read their configuration from config/, so a worker that supervisord restarts after ``inferd fleet
reload`` starts on the model the fleet serves now (the reload rewrites model.path and model.version there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from inferd.config import entry_tree
from inferd.fleet.files import RenderError, write_file
from inferd.fleet.render import Fleet
from inferd.settings import ModelSettings, resolve_model_path

SECRET_KEYS = ("admin_key", "api_keys", "metrics_key")


def worker_settings(fleet: Fleet) -> dict[str, Any]:
    """The workers' shared configuration: the fleet's effective settings, with every path made absolute."""
    s = fleet.settings
    data = s.model_dump(mode="json")
    data.pop("env", None)
    data.pop("fleet", None)
    model_path = resolve_model_path(s.model).resolve()
    data["model"]["path"] = str(model_path)
    # Pinned: a worker restarted after a reload must accept the same reload paths as the others.
    roots = [str(Path(r).expanduser().resolve()) for r in s.model.root] or [str(model_path.parent)]
    data["model"]["root"] = roots
    if s.model.device.startswith("cuda:"):
        data["model"]["device"] = "cuda"  # each worker sees its one GPU as cuda:0
    if s.canary.path:
        data["canary"]["path"] = str(Path(s.canary.path).expanduser().resolve())
    data["models"] = [_entry_paths(entry_tree(e)) for e in s.models]
    data["server"]["admin_key"] = fleet.admin_key
    data["server"]["host"] = "127.0.0.1"
    data["server"]["grpc_port"] = None  # each worker's own, from its environment (worker_environment)
    # Each worker enforces its part of every tenant's limits; nginx spreads requests (least_conn) and passes a 429
    # on to the next worker, so the fleet as a whole admits what the configuration says.
    data["server"]["tenant_limits_fraction"] = s.server.tenant_limits_fraction / len(fleet.layout.workers)
    return data


def _entry_paths(entry: dict[str, Any]) -> dict[str, Any]:
    """One ``models:`` entry as every worker reads it: absolute paths, roots pinned, one GPU as cuda."""
    settings = ModelSettings.model_validate({k: v for k, v in entry.items() if k in ModelSettings.model_fields})
    path = resolve_model_path(settings).resolve()
    entry["path"] = str(path)
    entry["root"] = [str(Path(r).expanduser().resolve()) for r in settings.root] or [str(path.parent)]
    if settings.device.startswith("cuda:"):
        entry["device"] = "cuda"
    canary = entry.get("canary") or {}
    if canary.get("path"):
        canary["path"] = str(Path(canary["path"]).expanduser().resolve())
    return entry


def redact(data: dict[str, Any]) -> dict[str, Any]:
    """A copy to print: the keys masked, as ``inferd check-config`` masks them."""
    out = json.loads(json.dumps(data))
    for key in SECRET_KEYS:
        if out.get("server", {}).get(key):
            out["server"][key] = "***"
    for tenant in out.get("server", {}).get("tenants") or ():
        tenant["keys"] = ["***"] * len(tenant.get("keys") or ())
    return out


_CONFIG_HEADER = ("# The workers' configuration, written by `inferd fleet` (and rewritten by `inferd fleet reload`,\n"
                  "# canary, promote and rollback, so a restarted worker serves what the others serve).\n"
                  "# server.port, server.admin_port and runtime.torch_threads are each worker's flags, and\n"
                  "# CUDA_VISIBLE_DEVICES / memory.per_process_fraction its environment, in supervisord.conf.\n")


def config_text(data: dict[str, Any]) -> str:
    return _CONFIG_HEADER + yaml.safe_dump(data, sort_keys=False)


def write_worker_config(run_dir: Path, env: str, data: dict[str, Any]) -> None:
    config = run_dir / "config"
    config.mkdir(mode=0o700, exist_ok=True)
    write_file(config / "base.yaml", config_text(data), 0o600)
    overlay = config / f"{env}.yaml"
    if not overlay.exists():
        write_file(overlay, "# Empty on purpose: base.yaml beside it holds the fleet's effective settings.\n", 0o600)


def read_worker_config(run_dir: Path) -> dict[str, Any]:
    data = yaml.safe_load((run_dir / "config" / "base.yaml").read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise RenderError(f"{run_dir / 'config' / 'base.yaml'} is not a mapping")
    return data
