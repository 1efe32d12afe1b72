"""The jobs' files on disk, under the data folder (never in the database: jobs/store.py names them).

``files/<file id>``: an uploaded input file or a batch's output or error file, written whole and durable before any
row names it (a temporary name, fsync, rename). ``chunks/<batch id>/<seq>-<token>.out|.err``: one chunk's output and
error records as one worker wrote them; ``token`` is that attempt's own, so a worker that lost its lease never
overwrites the file a committed row names. A batch's output file is its committed chunks' files, in order.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from inferd.jobs.lines import Record


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _durable(path: Path, parts: Iterable[bytes]) -> int:
    """``parts`` written to ``path`` whole or not at all, on disk before this returns; the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    size = 0
    with open(tmp, "wb") as out:
        for part in parts:
            out.write(part)
            size += len(part)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    return size


class FileStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir

    def path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / "files" / file_id

    def write(self, file_id: str, data: bytes) -> int:
        return _durable(self.path(file_id), (data,))

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def read_span(self, file_id: str, start: int, stop: int) -> bytes:
        with open(self.path(file_id), "rb") as f:
            f.seek(start)
            return f.read(stop - start)

    def remove(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)

    # -- chunk results -------------------------------------------------------------------------------------

    def _chunk_dir(self, batch_id: str) -> Path:
        return self.path(batch_id).parent.parent / "chunks" / batch_id

    def write_result(self, batch_id: str, seq: int, records: Sequence[Record]) -> str:
        """A chunk's records (in line order) durable under a name of this attempt's own; returns the name."""
        name = f"{seq:08d}-{secrets.token_hex(6)}"
        folder = self._chunk_dir(batch_id)
        ordered = sorted(records, key=lambda r: r.number)
        _durable(folder / f"{name}.out", (r.data + b"\n" for r in ordered if r.ok))
        _durable(folder / f"{name}.err", (r.data + b"\n" for r in ordered if not r.ok))
        return name

    def assemble(self, batch_id: str, results: Sequence[str], output_id: str, error_id: str) -> tuple[int, int]:
        """The output and error files from the committed chunks' ``results``; their sizes."""
        folder = self._chunk_dir(batch_id)

        def joined(suffix: str) -> Iterable[bytes]:
            for name in results:
                yield (folder / f"{name}{suffix}").read_bytes()

        return _durable(self.path(output_id), joined(".out")), _durable(self.path(error_id), joined(".err"))

    def remove_result(self, batch_id: str, name: str) -> None:
        """One attempt's result files (``write_result``'s name), not committed."""
        for suffix in (".out", ".err"):
            (self._chunk_dir(batch_id) / f"{name}{suffix}").unlink(missing_ok=True)

    def remove_results(self, batch_id: str) -> None:
        shutil.rmtree(self._chunk_dir(batch_id), ignore_errors=True)

    def remove_orphans(self, batch_id: str, kept: Sequence[str]) -> None:
        """The result files of attempts no committed row names (a worker killed before its commit)."""
        folder = self._chunk_dir(batch_id)
        keep = set(kept)
        for path in folder.glob("*.*") if folder.exists() else ():
            if path.stem not in keep and not path.name.startswith("."):
                path.unlink(missing_ok=True)
