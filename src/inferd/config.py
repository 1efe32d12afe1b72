"""The layered loader: one Settings (inferd.settings) built from YAML layers, environment variables and flags.

Order (later wins): configs/base.yaml < configs/<INFERD_ENV>.yaml < MODEL_PATH < INFERD__SECTION__KEY < flags.
Every leaf remembers where it came from, so a bad value is reported with its key *and* its source.
SIGHUP builds the settings again through the same function (inferd.server).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from inferd.settings import ModelEntry, Settings, env_name

ENV_PREFIX = "INFERD__"
# The keys of a ``models:`` entry beside the model settings themselves.
ENTRY_KEYS = ("name", "batching", "cache", "canary", "required", "default", "share", "aliases")


class RawValue(str):
    """A setting's value as text (``--set KEY=VALUE``), read by the key's type as an environment variable is."""


class ConfigError(Exception):
    """Configuration that cannot start a server; the message names the key and where it came from."""


def entry_tree(entry: ModelEntry) -> dict[str, Any]:
    """A served model as a ``models:`` entry in full (what ``inferd fleet`` writes for its workers); load_settings
    reads it back as the same ModelEntry, whatever the ``model:`` block beside it says."""
    model = entry.model.model_dump(mode="json")
    model.pop("name", None)
    return {"name": entry.name, **model, "batching": entry.batching.model_dump(mode="json"),
            "cache": entry.cache.model_dump(mode="json"), "canary": entry.canary.model_dump(mode="json"),
            "required": entry.required, "default": entry.default, "share": entry.share, "aliases": list(entry.aliases)}


def default_config_dir() -> Path:
    env = os.environ.get("INFERD_CONFIG_DIR")
    if env:
        return Path(env)
    cwd = Path.cwd() / "configs"
    if (cwd / "base.yaml").is_file():
        return cwd
    return Path(__file__).resolve().parents[2] / "configs"


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _merge(dst: dict[str, Any], src: Mapping[str, Any], sources: dict[str, str], origin: str,
           prefix: str = "") -> None:
    """Deep-merge src into dst, recording the origin of every leaf that src sets."""
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, sources, origin, path + ".")
        else:
            dst[key] = dict(value) if isinstance(value, Mapping) else value
            sources[path] = origin


def _record_leaves(sources: dict[str, str], prefix: str, tree: Mapping[str, Any], origin: str) -> None:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _record_leaves(sources, f"{prefix}.{key}", value, origin)
        else:
            sources[f"{prefix}.{key}"] = origin


def _env_value(raw: str, kind: str) -> Any:
    if kind == "list" and not raw.lstrip().startswith("["):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if kind in ("str", "str?"):
        # Text fields take the variable as written: YAML would turn VERSION=2 into an int, a key into a bool.
        return None if kind == "str?" and raw.strip() in ("", "null", "~") else raw
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[path[-1]] = value


def _field_kind(path: list[str]) -> str:
    """How to read an env value for this key: "list", "str", "str?" (optional text) or "other"."""
    model: Any = Settings
    for part in path:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return "other"
        model = fields[part].annotation
    if getattr(model, "__origin__", None) in (tuple, list):
        return "list"
    if model is str:
        return "str"
    return "str?" if model == (str | None) else "other"


def _entry_kind(rest: list[str]) -> str:
    """``_field_kind`` for a key under one ``models:`` entry (its own sections, or a model setting)."""
    if rest and rest[0] in ("batching", "cache", "canary"):
        return _field_kind(rest)
    return _field_kind(["model", *rest])


def _env_layer(environ: Mapping[str, str]) -> list[tuple[list[str], str, str]]:
    """(key path, raw value, origin) per variable; values are read once the path's model is known."""
    out = []
    if environ.get("MODEL_PATH"):
        out.append((["model", "path"], environ["MODEL_PATH"], "env MODEL_PATH"))
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not parts:
            raise ConfigError(f"environment variable {name} names no configuration key")
        out.append((parts, environ[name], f"env {name}"))
    return out


def _models_by_name(data: dict[str, Any], origin: str) -> None:
    """A layer's ``models:`` list as a mapping by name, so that overlays, environment variables and flags reach
    one entry by its name (an overlay's entry of a known name changes it; of a new name, adds it)."""
    models = data.get("models")
    if models is None:
        return
    if isinstance(models, Mapping):  # already by name
        entries = [{**(e if isinstance(e, Mapping) else {"": e}), "name": str(n)} for n, e in models.items()]
    elif isinstance(models, list):
        entries = models
    else:
        raise ConfigError(f"models in {origin}: must be a list of models, each a mapping with a name")
    out: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "" in entry:
            raise ConfigError(f"models[{i}] in {origin}: must be a mapping of settings with a name")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"models[{i}] in {origin}: needs a name (the model clients ask for)")
        if name in out:
            raise ConfigError(f"models[{i}] in {origin}: a second model named {name!r}")
        out[name] = dict(entry)
    data["models"] = out


def _replace_models(tree: dict[str, Any], sources: dict[str, str], value: Any, origin: str) -> None:
    """A whole ``models:`` list from the environment or a flag: it replaces the files' list."""
    layer = {"models": value}
    _models_by_name(layer, origin)
    tree["models"] = layer["models"]
    for key in [k for k in sources if k == "models" or k.startswith("models.")]:
        del sources[key]
    sources["models"] = origin
    _record_leaves(sources, "models", layer["models"] or {}, origin)


def _model_path(tree: dict[str, Any], parts: list[str], origin: str, dotted: bool) -> list[str]:
    """``models.<name>.<key>`` with ``<name>`` as configured: an environment variable spells it as env_name
    does; a flag's dotted key holds it as written (a name may hold dots, so the longest name that fits wins)."""
    names = list(tree.get("models") or {})
    if dotted:
        rest = ".".join(parts[1:])
        for name in sorted(names, key=len, reverse=True):
            if rest.startswith(name + "."):
                return ["models", name, *rest[len(name) + 1:].split(".")]
        wanted = parts[1] if len(parts) > 1 else ""
    else:
        wanted = parts[1] if len(parts) > 2 else ""
        for name in names:
            if env_name(name) == wanted:
                return ["models", name, *parts[2:]]
    served = ", ".join(names) or "none: no models: list is configured"
    raise ConfigError(f"{origin}: names no configured model (models.{wanted or '?'}...; the models: {served})")


def _alias_sources(sources: dict[str, str], src: str, dst: str) -> None:
    for key, origin in list(sources.items()):
        if key == src or key.startswith(src + "."):
            sources[dst + key[len(src):]] = origin


def _build_models(tree: dict[str, Any], sources: dict[str, str]) -> list[str]:
    """Each ``models:`` entry as ModelEntry's fields: the ``model:`` block under the entry's own model keys,
    the ``batching:`` and ``cache:`` sections under the entry's own. Returns the names, in order."""
    models = tree.get("models") or {}
    if not models:
        tree.pop("models", None)
        return []
    if (tree.get("canary") or {}).get("path"):
        raise ConfigError("canary: with a models: list, a canary is one model's: set models.<name>.canary "
                          f"(canary.path from {sources.get('canary.path', 'defaults')})")
    built = []
    for i, (name, raw) in enumerate(models.items()):
        own = {k: v for k, v in raw.items() if k in ENTRY_KEYS}
        model = copy.deepcopy(tree.get("model") or {})
        _merge(model, {k: v for k, v in raw.items() if k not in ENTRY_KEYS}, {}, "")
        model["name"] = name
        entry: dict[str, Any] = {**{k: v for k, v in own.items() if k in ("required", "default", "share", "aliases")},
                                 "name": name, "model": model, "canary": own.get("canary") or {}}
        _alias_sources(sources, "model", f"models.{i}.model")
        for section in ("batching", "cache"):
            entry[section] = copy.deepcopy(tree.get(section) or {})
            if isinstance(own.get(section), Mapping):
                _merge(entry[section], own[section], {}, "")
            else:
                entry[section] = own.get(section, entry[section])
            _alias_sources(sources, section, f"models.{i}.{section}")
        for key in raw:
            target = key if key in ENTRY_KEYS else f"model.{key}"
            _alias_sources(sources, f"models.{name}.{key}", f"models.{i}.{target}")
        built.append(entry)
    tree["models"] = built
    return list(models)


def _source_of(loc: tuple[Any, ...], sources: Mapping[str, str]) -> str:
    parts = [str(p) for p in loc]
    # A key that holds others (a section, or an unknown key set with sub-keys) names every source beneath it
    # too: a section-level error may come from any of them.
    prefix = ".".join(parts) + "."
    below = sorted({origin for key, origin in sources.items() if key.startswith(prefix)})
    while parts:
        key = ".".join(parts)
        if key in sources:
            return ", ".join(dict.fromkeys([sources[key], *below]))
        parts.pop()
    return ", ".join(below) or "defaults"


def _key_of(loc: tuple[Any, ...], names: list[str]) -> str:
    """An error's key as the operator wrote it: ``models.<name>.<key>``, not the entry's position."""
    parts = [str(p) for p in loc]
    if len(parts) >= 2 and parts[0] == "models" and parts[1].isdigit() and int(parts[1]) < len(names):
        rest = parts[3:] if parts[2:3] == ["model"] else parts[2:]
        parts = ["models", names[int(parts[1])], *rest]
    return ".".join(parts) or "(top level)"


def load_settings(
    env: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_dir: Path | None = None,
) -> Settings:
    """Build the effective Settings: base.yaml ⊕ <env>.yaml ⊕ environment ⊕ overrides (dotted keys).

    A ``models:`` list is read by name in every layer (INFERD__MODELS__<NAME>__KEY, ``models.<name>.key``),
    then each entry is built over the ``model:``, ``batching:`` and ``cache:`` blocks (its defaults).
    """
    environ = os.environ if environ is None else environ
    config_dir = config_dir or default_config_dir()
    env = env or environ.get("INFERD_ENV") or "dev"
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    base = config_dir / "base.yaml"
    overlay = config_dir / f"{env}.yaml"
    if not overlay.is_file():
        raise ConfigError(f"INFERD_ENV={env!r} but there is no overlay {overlay}")
    for path in (base, overlay):
        layer = _read_yaml(path)
        _models_by_name(layer, str(path))
        _merge(tree, layer, sources, str(path))
        # Every key of every entry, from its own layer (to _merge, the first layer's list is one leaf).
        _record_leaves(sources, "models", layer.get("models") or {}, str(path))
    for parts, raw, origin in _env_layer(environ):
        if parts == ["models"]:  # the whole list, as YAML
            _replace_models(tree, sources, _env_value(raw, "other"), origin)
            continue
        if parts[0] == "models":
            parts = _model_path(tree, parts, origin, dotted=False)
            value = _env_value(raw, _entry_kind(parts[2:]))
        else:
            value = _env_value(raw, _field_kind(parts))
        _set_path(tree, parts, value)
        sources[".".join(parts)] = origin
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        parts = dotted.split(".")
        origin = f"flag --{parts[-1].replace('_', '-')}"
        if parts == ["models"]:
            _replace_models(tree, sources, value, f"flag {dotted}")
            continue
        if parts[0] == "models":
            parts = _model_path(tree, parts, f"flag --set {dotted}", dotted=True)
        if isinstance(value, RawValue):
            origin = f"flag --set {dotted}"
            value = _env_value(value, _entry_kind(parts[2:]) if parts[0] == "models" else _field_kind(parts))
        _set_path(tree, parts, value)
        sources[".".join(parts)] = origin
    tree["env"] = env
    names = _build_models(tree, sources)
    try:
        return Settings.model_validate(tree)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"  {_key_of(err['loc'], names)}: {what} (from {_source_of(err['loc'], sources)})")
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None
