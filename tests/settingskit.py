"""Settings for tests: ``make_settings``, the one factory every suite builds its Settings with (issue 28).

Two kinds, one function:

- ``make_settings(path, **overrides)``: the schema's defaults (inferd.settings) under ``QUIET``, what the suites'
  own copies shared: the model loads when the app or engine starts (``load_mode: eager``) with no warm-up pass,
  and a batch never waits for companions (``batching.max_wait_ms: 0``), so a fake handler's test is not timed by
  the batcher. The device stays the schema's ``auto``, as those suites had it; a test that needs another value
  says so (``model={"load_mode": "lazy"}``).
- ``make_settings(path, layered="dev", **overrides)``: this repository's configs/base.yaml under
  configs/<layered>.yaml, layered by ``inferd.config.load_settings`` as ``inferd serve`` layers them, and nothing
  of ``QUIET``. The environment layer is ``environ`` alone (none unless given): never the process's, which a
  developer's shell or CI may set (INFERD__*, MODEL_PATH, INFERD_CONFIG_DIR). ``config_dir`` reads another folder
  of layers.

``model_path`` is ``model.path``. The overrides apply after it, in the order written, each over what is there
(so a suite's own base, ``**SUITE``, goes first and a test's change after it):

- a section as a mapping is merged key by key, nested mappings too: ``model={"version": "v1"}``,
  ``server={"admin_key": "k"}``;
- a section as a settings object (``shadow=ShadowSettings(max_batch_size=4)``), or any other value
  (``models=(entry, ...)``), is taken whole: a ``BatchingSettings(...)`` brings its own ``max_wait_ms``;
- a dotted key sets one leaf: ``**{"batching.max_wait_ms": 5}``; in layered settings also
  ``**{"models.<name>.<key>": ...}``, as ``--set`` reaches one model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from inferd.config import load_settings
from inferd.settings import Settings

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
QUIET: dict[str, dict[str, Any]] = {"model": {"warmup": False, "load_mode": "eager"},
                                    "batching": {"max_wait_ms": 0.0}}


def make_settings(model_path: str | Path | None = None, *, layered: str | None = None,
                  config_dir: Path | None = None, environ: Mapping[str, str] | None = None,
                  **overrides: Any) -> Settings:
    """Settings for a test: the schema's defaults under QUIET, or (``layered``) the config files'; see above."""
    if layered is None and (config_dir is not None or environ is not None):
        raise TypeError("config_dir and environ are read by layered settings only (layered='dev')")
    changes = list(_changes(model_path, overrides))
    if layered is not None:
        # A settings object as the loader's tree holds a section: a mapping (an entry of models: merges into it).
        dotted = {".".join(path): value.model_dump() if isinstance(value, BaseModel) else value
                  for path, value in changes}
        return load_settings(layered, dotted, environ=dict(environ or {}), config_dir=config_dir or CONFIGS)
    tree: dict[str, Any] = copy.deepcopy(QUIET)
    for path, value in changes:
        _put(tree, path, value)
    return Settings.model_validate(tree)


def _changes(model_path: str | Path | None, overrides: Mapping[str, Any]) -> Iterator[tuple[list[str], Any]]:
    """(key path, value) per leaf to set, in the order written."""
    if model_path is not None:
        yield ["model", "path"], str(model_path)
    for key, value in overrides.items():
        if "." in key:
            yield key.split("."), value
        else:
            yield from _leaves([key], value)


def _leaves(path: list[str], value: Any) -> Iterator[tuple[list[str], Any]]:
    if isinstance(value, Mapping):  # an empty one changes nothing (``batching={}`` keeps QUIET's wait)
        for key, inner in value.items():
            yield from _leaves([*path, str(key)], inner)
    else:
        yield path, value


def _put(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.get(part)
        if isinstance(node, BaseModel):  # a section taken whole, then one of its keys changed
            node = node.model_dump()
        if not isinstance(node, dict):
            node = {}
        tree[part] = node
        tree = node
    tree[path[-1]] = value
