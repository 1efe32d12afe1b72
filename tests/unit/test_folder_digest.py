"""A model folder's digest (the cache key's ``model``) is read once per process while no file changes: backend auto
opens one model on several candidates in turn; any change of a file's size or modification time reads it again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inferd.core.backends import factory


def test_the_digest_is_reused_until_a_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / ".hidden").write_text("not part of the model")
    first = factory.folder_digest(tmp_path)
    reads: list[Path] = []
    real_open = Path.open

    def counting(self: Path, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        reads.append(self)
        return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "open", counting)
    assert factory.folder_digest(tmp_path) == first and reads == []
    # Same size, other bytes, a later modification time: read again, another digest.
    (tmp_path / "config.json").write_text('{"a": 2}')
    stat = (tmp_path / "config.json").stat()
    os.utime(tmp_path / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    reads.clear()  # the write's own open
    changed = factory.folder_digest(tmp_path)
    assert changed != first and reads == [tmp_path / "config.json"]
