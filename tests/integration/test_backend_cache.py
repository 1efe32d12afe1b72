"""The backend cache's entries checked at every open (core/backends/cache_entries.py ``check_entry``): a graph
that is not the one written (a flipped byte, a file cut short), a meta.json that cannot be read, an entry of another
format, a damaged shared export: each is moved aside and built again, with a warning naming it, and never served.

OpenVINO float32 on the tiny BERT, the gate on 32 texts: an export and its gate take seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.core.backends import factory
from inferd.core.backends import openvino as ov_backend
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.core.tasks.embedding import EmbeddingHandler

TEXTS = ["the cat read a book about rivers", "hello world", "我们 的 模型", "a long text " * 20]
FACTORY_LOG = factory.__name__


def spec(model: Path, cache: Path) -> ModelSpec:
    return ModelSpec(path=model, name="tiny", version="1", device="cpu", backend="openvino", dtype="float32",
                     cache_dir=str(cache), gate=(("texts", 32), ("calibration_texts", 16)), warmup=False)


def load(model: Path, cache: Path) -> tuple[dict, np.ndarray]:
    """The load's backend_info, and its vectors of TEXTS."""
    h = load_handler(spec(model, cache))
    assert isinstance(h, EmbeddingHandler)
    try:
        return dict(h.loaded.backend_info or {}), h.infer(h.preprocess(TEXTS))
    finally:
        h.close()


@pytest.fixture(scope="module")
def torch_vectors(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    h = load_handler(ModelSpec(path=tiny_model, name="tiny", version="1", device="cpu", warmup=False))
    try:
        return h.infer(h.preprocess(TEXTS))
    finally:
        h.close()


def flip(file: Path) -> None:
    """64 bytes in the middle inverted, in place: the same size, and the same inode (its hard links see it too)."""
    size = file.stat().st_size
    with file.open("r+b") as f:
        f.seek(size // 2)
        block = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))


def cut(file: Path) -> None:
    with file.open("r+b") as f:
        f.truncate(file.stat().st_size // 2)


@pytest.mark.parametrize(("damage", "said"), [(flip, "model.bin is not the file written (its sha256 differs)"),
                                              (cut, "model.bin holds ")])
def test_a_damaged_graph_is_built_again_not_served(tiny_model: Path, tmp_path: Path, torch_vectors: np.ndarray,
                                                   caplog: pytest.LogCaptureFixture,
                                                   damage: Callable[[Path], None], said: str) -> None:
    first, _ = load(tiny_model, tmp_path)
    entry = Path(first["cache_entry"])
    export = next(tmp_path.glob("export-*"))
    # The entry's graph is a hard link to the shared export's: one damage reaches both.
    assert os.path.samefile(entry / "model.bin", export / "model.bin")
    damage(entry / "model.bin")
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG):
        again, vectors = load(tiny_model, tmp_path)
    assert again["cache"] == "miss" and again["cache_entry"] == str(entry)
    assert f"cache entry {entry} is broken ({said}" in caplog.text
    assert f"cache entry {export} is broken ({said}" in caplog.text  # exported again, not linked from the damage
    np.testing.assert_allclose(vectors, torch_vectors, atol=1e-4)
    # Repaired for good: the next open is a hit, and nothing moved aside is left behind.
    assert load(tiny_model, tmp_path)[0]["cache"] == "hit"
    left = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert sorted(left) == sorted([entry.name, export.name])


def cut_meta(entry: Path) -> None:
    text = (entry / factory.META).read_text()
    (entry / factory.META).write_text(text[: len(text) // 2])


def older_meta(entry: Path) -> None:
    meta = json.loads((entry / factory.META).read_text())
    (entry / factory.META).write_text(json.dumps({**meta, "format": factory.FORMAT - 1}))


@pytest.mark.parametrize(("breakage", "said"), [
    (cut_meta, "meta.json is not valid JSON"),
    (lambda entry: (entry / factory.META).unlink(), "no meta.json"),
    (older_meta, f"meta.json of format {factory.FORMAT - 1}, where this inferd writes {factory.FORMAT}"),
])
def test_an_entry_whose_meta_cannot_be_read_is_replaced_once_not_exported_at_every_start(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, breakage: Callable[[Path], None],
        said: str) -> None:
    """The new build could not be renamed onto the broken folder, was taken for another process's and thrown away:
    every later start exported again, in the foreground."""
    entry = Path(load(tiny_model, tmp_path)[0]["cache_entry"])
    breakage(entry)
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG):
        assert load(tiny_model, tmp_path)[0]["cache"] == "miss"
    assert f"cache entry {entry} is broken ({said}" in caplog.text
    assert factory.check_entry(entry)[1] is None
    assert load(tiny_model, tmp_path)[0]["cache"] == "hit"


def test_a_damaged_shared_export_is_exported_again_for_the_next_entry(
        tiny_model: Path, tmp_path: Path, torch_vectors: np.ndarray, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The export every dtype and quantisation of a model links from is checked where it is reused: a damaged copy
    there (here a new file, so the first entry's own link stays whole) would become every later entry's graph."""
    entry = Path(load(tiny_model, tmp_path)[0]["cache_entry"])
    export = next(tmp_path.glob("export-*"))
    damaged = tmp_path / "damaged.bin"
    shutil.copyfile(export / "model.bin", damaged)
    flip(damaged)
    os.replace(damaged, export / "model.bin")
    assert factory.check_entry(entry)[1] is None  # the entry's own link is the file it was built with
    shutil.rmtree(entry)  # so it is built again from the shared export
    exports: list[Path] = []
    real_export = ov_backend.export

    def export_counted(*args: Any, **kw: Any) -> Path:
        exports.append(real_export(*args, **kw))
        return exports[-1]

    monkeypatch.setattr(ov_backend, "export", export_counted)
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOG):
        info, vectors = load(tiny_model, tmp_path)
    assert info["cache"] == "miss" and len(exports) == 1
    assert f"cache entry {export} is broken (model.bin is not the file written" in caplog.text
    np.testing.assert_allclose(vectors, torch_vectors, atol=1e-4)
