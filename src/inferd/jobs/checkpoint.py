"""The checkpoint of an ``inferd batch`` run: which input, how far, and how much of the output is committed.

``OUT.checkpoint`` (JSON) is replaced atomically (written beside, fsynced, renamed, the folder fsynced) only after
the chunk it counts is durable in the output, so after a ``kill -9`` at any moment the output holds at least what
the checkpoint says and perhaps one chunk more, which the resume cuts off (JSONL: truncated to ``out_bytes``;
Parquet: the chunk's part file is written again) before it runs that chunk again. Every input line therefore
ends in the output exactly once, whatever the chunk size of either run. The input is named by its size and
SHA-256, so a checkpoint is never resumed against another file or endpoint; and the model by what decides its
outputs (``model``: its folder's content, runtime, pooling, normalisation, ...), so a resume never appends one
model's vectors to another's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# 2: the model's fingerprint (``model``). A version 1 checkpoint names no model, so it cannot be held to one.
VERSION = 2


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed; the message says why and what to do."""


@dataclass(frozen=True)
class Checkpoint:
    input_sha256: str
    input_size: int
    endpoint: str
    total_lines: int
    lines_done: int = 0  # records written (blank lines are no lines)
    failed: int = 0
    next_line: int = 0  # the first line (its place in the file, as jobs/lines.py numbers it) not done
    in_offset: int = 0  # JSONL input: the byte after the last line done, so a resume seeks instead of re-reading
    out_bytes: int = 0  # JSONL output: the committed length
    parts: int = 0  # Parquet output: the committed part files
    # What decides the outputs (jobs/offline.py model_fingerprint), as JSON gives it back; None: not known yet.
    model: dict[str, Any] | None = None
    version: int = VERSION

    def advanced(self, lines: int, failed: int, next_line: int, in_offset: int, out_bytes: int,
                 parts: int) -> Checkpoint:
        return replace(self, lines_done=self.lines_done + lines, failed=self.failed + failed, next_line=next_line,
                       in_offset=in_offset, out_bytes=out_bytes, parts=parts)

    @property
    def finished(self) -> bool:
        return self.lines_done >= self.total_lines


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + ".checkpoint")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX: the directory entry lives in the folder's own blocks)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save(out: Path, checkpoint: Checkpoint) -> None:
    replace_atomically(checkpoint_path(out), json.dumps(asdict(checkpoint), indent=1).encode())


def load(out: Path) -> Checkpoint | None:
    """The checkpoint beside ``out``, or None when there is none."""
    path = checkpoint_path(out)
    try:
        raw = json.loads(path.read_bytes())
        if raw.get("version") != VERSION:
            raise CheckpointError(f"{path}: version {raw.get('version')!r}, this inferd writes {VERSION} (an older "
                                  "one did not record the model the lines ran on); give --restart to start over")
        return Checkpoint(**raw)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path} is not a checkpoint of inferd batch ({exc}); give --restart to start "
                              "over") from exc


def check_resumable(found: Checkpoint, wanted: Checkpoint, out: Path) -> None:
    """Refuse a checkpoint of another run: a resume must run the same lines the same way."""
    for field, label in (("input_sha256", "input file"), ("input_size", "input file"), ("endpoint", "endpoint"),
                         ("total_lines", "input file")):
        if getattr(found, field) != getattr(wanted, field):
            raise CheckpointError(
                f"{checkpoint_path(out)} belongs to another run (its {label} differs: {getattr(found, field)!r}, "
                f"now {getattr(wanted, field)!r}); give --restart to start over, or another --out")


def check_same_model(found: Checkpoint, model: dict[str, Any], out: Path) -> None:
    """Refuse a resume whose model would answer differently from the one that wrote the lines done: the output would
    hold two models' vectors (or scores) with nothing to tell them apart."""
    before = found.model or {}
    changed = [f"{key} {before.get(key)!r}, now {model.get(key)!r}" for key in sorted(before.keys() | model.keys())
               if before.get(key) != model.get(key)]
    if changed:
        raise CheckpointError(
            f"{checkpoint_path(out)}: its {found.lines_done} lines were run by another model or other model settings "
            f"({'; '.join(changed)}); run with the settings of the first run to resume, or give --restart to start "
            "over")


def remove(out: Path) -> None:
    checkpoint_path(out).unlink(missing_ok=True)
    fsync_dir(out.parent)
