"""Building a loaded handler from a spec, and the checks a model path and the files in it must pass.

Every file a load opens resolves, symlinks followed, under one of the spec's ``files_roots`` (the
``model.root`` entries): a folder an admin key may load cannot make the server read, or say whether there is, a
file anywhere else. The files are the folder's (the model, tokenizer and sentence-transformers files, read by
name from the folder and its module folders) and those a file of it names: modules.json's module paths and a
sharded checkpoint's index (``*.index.json``' ``weight_map``); each is checked before anything is loaded, and
refused naming the path relative to the folder, never where it leads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlparse

from inferd.core import load_guard
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler, ModelLoadError, resolve_device
from inferd.core.tasks.handlers import detect_task, handler_for
from inferd.core.tasks.st_files import inside_folder, modules


def spec_task(spec: ModelSpec) -> str:
    """The task a spec will serve: as configured, or (``auto``) as the model folder says; ``model.pooling: splade``
    is an embedding model's (a bare masked-LM folder would be ambiguous by its files alone)."""
    if spec.task == "auto" and spec.pooling == "splade":
        return "embedding"
    return detect_task(spec.path) if spec.task == "auto" else spec.task


def load_handler(spec: ModelSpec) -> Handler:
    """Build the task's handler, load the weights on the device and warm it up; a guarded change abandoned
    meanwhile (core/load_guard.py) stops between these stages, and what it built is closed."""
    load_guard.stage("checking the folder")
    check_confined(spec.path, spec.files_roots)
    handler = handler_for(spec_task(spec), spec.path, spec.pooling)
    load_guard.stage("loading the model")
    handler.open(spec, resolve_device(spec.device))
    try:
        load_guard.stage("warm-up")
        if spec.warmup:
            handler.warmup()
        load_guard.stage("warmed up")
    except ModelLoadError:
        handler.close()
        raise
    return handler


def check_model_path(raw: str, roots: list[Path]) -> Path:
    """Accept only local folders under one of the allowed roots; no URLs, no '..' escapes."""
    if not raw or not isinstance(raw, str):
        raise ModelLoadError("path must be a non-empty string")
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        # A NUL would make the OS calls below raise ValueError; no folder name needs control characters.
        raise ModelLoadError("path must not contain control characters")
    parsed = urlparse(raw)
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter would be a Windows drive
        raise ModelLoadError(f"path {raw!r}: only local folders are allowed, not {parsed.scheme}:// URLs")
    if ".." in Path(raw).parts:
        raise ModelLoadError(f"path {raw!r}: '..' is not allowed")
    try:
        path = Path(raw).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a name too long, a symlink loop, an unknown ~user
        raise ModelLoadError(f"path {raw!r} cannot be resolved: {exc}") from None
    for root in roots:
        if path == root or root in path.parents:
            return path
    allowed = ", ".join(str(r) for r in roots) or "(none)"
    raise ModelLoadError(f"path {raw!r} is not under an allowed model.root ({allowed})")


_OUTSIDE = "is a link that leads outside model.root"


def _under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _links_out(folder: Path, roots: tuple[Path, ...]) -> tuple[Path, str] | None:
    """The first entry of the folder's tree (module folders and linked folders included) that is a symlink
    resolving outside the roots, or neither a file nor a folder (a FIFO would hang the reader that opens it),
    relative to the folder, and what is wrong with it; None when there is none."""
    seen: set[Path] = set()
    todo = [folder]
    while todo:
        here = todo.pop()
        real = here.resolve()
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            continue  # unreadable: the load that needs it names it
        for entry in entries:
            path = Path(entry.path)
            if entry.is_symlink():
                try:
                    target = path.resolve(strict=False)
                except (OSError, RuntimeError):  # a loop: it leads nowhere under the root either
                    return path.relative_to(folder), _OUTSIDE
                if not _under(target, roots):
                    return path.relative_to(folder), _OUTSIDE
            if entry.is_dir(follow_symlinks=True):
                todo.append(path)
            elif not entry.is_file(follow_symlinks=True) and path.exists():
                return path.relative_to(folder), "is not a regular file (a pipe, socket or device)"
    return None


def check_confined(path: Path, files_roots: tuple[Path, ...] | Path = ()) -> None:
    """Refuse a folder when a file its load would open resolves outside every one of ``files_roots`` (none:
    the folder's parent), naming that file relative to the folder."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return  # the handler's load names a missing folder
    real = folder.resolve()
    given = (files_roots,) if isinstance(files_roots, Path) else files_roots
    roots = tuple(r.expanduser().resolve() for r in given) or (real.parent,)
    if not _under(real, roots):
        raise ModelLoadError(f"model folder {folder} is not under model.root")
    # Links first: the files read below (modules.json, an index) are then known to be the root's own.
    wrong = _links_out(folder, roots)
    if wrong is not None:
        raise ModelLoadError(f"{wrong[0]} in the model folder {wrong[1]}; every file a model load opens must be a "
                             "file under model.root")
    mods = modules(folder) or []  # refuses a module path that leaves the folder, as written
    for index in sorted(folder.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        except (OSError, ValueError, AttributeError):
            continue  # not a checkpoint index; the model's loader names an unreadable one
        if isinstance(weight_map, dict):
            for shard in sorted({v for v in weight_map.values() if isinstance(v, str)}):
                inside_folder(shard, f"{index.name}'s weight_map")
    for m in mods:
        if not _under((folder / m.path).resolve(), roots):
            raise ModelLoadError(f"modules.json: module {m.idx} ({m.path}) leads outside model.root")
