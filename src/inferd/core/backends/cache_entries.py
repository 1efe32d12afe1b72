"""A runtime cache entry's folder as files on disk: what it must hold (``FORMAT``, its record of each file's size and
sha256), whether it can be served (``check_entry``, ``checked``), moving a broken one aside (``discard``), and the
lock one builder holds while it makes one (``entry_lock``). core/backends/factory.py decides what goes in an entry
and builds it; this module only keeps entries whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inferd.core.backends.base import BackendError

log = logging.getLogger(__name__)

# Bump when what an entry holds, or how it is made, changes (6: mixed keeps attention in float32; 7: meta.json and
# the shared export record each file's size and sha256).
FORMAT = 7
META = "meta.json"
# The shared export's record of its files (an entry's is in its meta.json).
EXPORT_RECORD = "files.json"


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Held while an entry is built: a fleet's workers on one cache folder, or pods on a shared volume, wait for the
    first one's export and read its entry, instead of each exporting the same model at once (an flock on a file
    beside the entry; the kernel lets it go with the process, so a killed builder leaves no stale lock). Where the
    folder cannot be written the build itself says so; no lock is taken."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle = (entry.parent / f".{entry.name}.lock").open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            # Work folders of this entry (``.<entry>.<random>``, and broken ones moved aside) are made only under this
            # lock: any found now is a dead builder's (kill -9 mid-export), a full copy of a graph where the cache
            # cannot hard-link, left for ever otherwise.
            for stale in entry.parent.glob(f".{glob.escape(entry.name)}.*"):
                if stale.is_dir():
                    log.info("removing %s, left by a build that did not finish", stale)
                    shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Each file under ``folder`` by its relative path: its size and sha256 (what ``damage`` checks)."""
    files = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        with file.open("rb") as f:
            files[str(file.relative_to(folder))] = {"size": file.stat().st_size,
                                                    "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    return files


def damage(folder: Path, files: dict[str, Any]) -> str | None:
    """What differs between ``folder``'s files and their record (missing, another size, another sha256); None when
    every one is whole. The sizes catch a truncated copy at no cost; the hashes a flipped byte, which OpenVINO would
    serve as wrong vectors without a word. Every open of an entry pays the hashing: 0.05 s for MiniLM's float32 graph
    (90 MB, from the page cache, on a 2-core EPYC), against the tens of seconds of the export it stands in for."""
    for name, want in files.items():
        file = folder / name
        try:
            size = file.stat().st_size
            if size != want["size"]:
                return f"{name} holds {size} bytes, {want['size']} were written"
            with file.open("rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != want["sha256"]:
                    return f"{name} is not the file written (its sha256 differs)"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
        except (KeyError, TypeError):
            return f"the record of {name} is not one this inferd writes"
    return None


def checked(folder: Path, record: str) -> tuple[dict[str, Any] | None, str | None]:
    """A folder's record (``META`` of an entry, ``EXPORT_RECORD`` of the shared export) when the folder can be
    served, else why not: (None, None) where there is no folder, (None, a reason) where it is broken (no record, a
    record that cannot be read or is of another format, a file that is not the one recorded)."""
    if not folder.is_dir():
        return None, None
    try:
        meta = json.loads((folder / record).read_text())
    except FileNotFoundError:
        return None, f"no {record}"
    except OSError as exc:
        return None, f"{record} cannot be read ({exc.strerror})"
    except ValueError:
        return None, f"{record} is not valid JSON (cut short?)"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        return None, f"{record} of format {found!r}, where this inferd writes {FORMAT}"
    if not isinstance(meta.get("files"), dict):
        return None, f"{record} records no files"
    problem = damage(folder, meta["files"])
    return (None, problem) if problem else (meta, None)


def check_entry(entry: Path) -> tuple[dict[str, Any] | None, str | None]:
    """An entry's meta.json when the entry can be served, else why not (``checked``)."""
    return checked(entry, META)


def discard(folder: Path, why: str) -> None:
    """A broken entry (or shared export) moved aside, then removed, so it is built again: a rename first, so a
    process that reads it now keeps whole files, and the name is free at once for the new one."""
    log.warning("cache entry %s is broken (%s): removing it and building it again", folder, why)
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.broken-", dir=folder.parent))
    try:
        os.rename(folder, aside / folder.name)
    except OSError as exc:
        shutil.rmtree(aside, ignore_errors=True)
        raise BackendError(f"cache entry {folder} is broken ({why}) and cannot be removed ({exc.strerror}): remove "
                           "it, or set model.cache_dir to a writable folder") from exc
    shutil.rmtree(aside, ignore_errors=True)
