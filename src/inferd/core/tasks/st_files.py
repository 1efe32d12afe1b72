"""A sentence-transformers folder's files: its JSON files, read and confined to the folder, and modules.json's list.

Every path a folder's file names stays inside the folder (a module path of ``/etc`` or ``../x`` is refused as
written, without looking at what is there), and every error names files relative to the folder, so a refusal says
nothing of the machine beyond it. What the modules say is core/tasks/st_modules.py's, and the folder as a whole
(the chain they make) core/tasks/st_folder.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from inferd.core.errors import ModelLoadError


@dataclass(frozen=True)
class Module:
    """One entry of modules.json: its index, its path inside the folder and its class name."""

    idx: int
    path: str
    type: str

    @property
    def kind(self) -> str:
        return self.type.rpartition(".")[2]

    def describe(self) -> str:
        return f"module {self.idx} ({self.path or '.'}: {self.type})"


def json_file(folder: Path, name: str) -> Any:
    """A JSON file of the folder, None when absent; an unreadable one is refused by its name in the folder."""
    path = folder / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else f"not valid JSON ({exc})"
        raise ModelLoadError(f"{name} in the model folder cannot be read: {reason}") from None


def inside_folder(path: str, what: str) -> str:
    """A path a folder's file names, refused unless it is relative and stays inside the folder (decided on
    the text alone, so the answer says nothing of what exists elsewhere)."""
    pure = PurePosixPath(path.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or (path[1:2] == ":"):
        raise ModelLoadError(f"{what}: path {path!r} leaves the model folder; the files a model folder names "
                             "must be inside it")
    return "" if str(pure) == "." else str(pure)


def modules(folder: Path) -> list[Module] | None:
    """modules.json's entries, in order; None when the folder has none."""
    raw = json_file(folder, "modules.json")
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ModelLoadError("modules.json in the model folder must be a list of modules")
    out = []
    for i, m in enumerate(raw):
        kind, path = m.get("type"), m.get("path", "")
        if not isinstance(kind, str) or not isinstance(path, str):
            raise ModelLoadError(f"modules.json: module {i} needs a 'type' and a 'path' (strings)")
        idx = m.get("idx", i)
        out.append(Module(idx if isinstance(idx, int) else i, inside_folder(path, f"modules.json module {i}"), kind))
    return sorted(out, key=lambda m: m.idx)
