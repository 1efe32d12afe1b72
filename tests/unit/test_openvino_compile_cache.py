"""core/backends/openvino.py: a compile cache that fails to load (a blob another process is still writing) falls back
to compiling the graph without it, instead of failing the load; a graph that cannot be read or compiled is a
BackendError naming it, whichever step reads it."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest


def _graph(folder: Path) -> Path:
    import openvino as ov
    import openvino.opset13 as ops

    ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    ov.save_model(ov.Model([ops.convert(ops.multiply(ids, mask), ov.Type.f32)], [ids, mask]), folder / "g.xml")
    return folder / "g.xml"


def test_a_compile_cache_that_fails_to_load_is_bypassed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    import openvino as ov

    from inferd.core.backends import openvino as runner_module

    class Core(ov.Core):  # type: ignore[misc]
        """A Core whose compile fails while a compile cache is set, as a torn blob in it makes the real one fail."""

        def set_property(self, *args: Any) -> None:
            self.cached = True
            super().set_property(*args)

        def compile_model(self, *args: Any, **kw: Any) -> Any:
            if getattr(self, "cached", False):
                raise RuntimeError("Exception from src/inference/src/cache_manager: blob is truncated")
            return super().compile_model(*args, **kw)

    monkeypatch.setattr(runner_module, "_ov", lambda: SimpleNamespace(Core=Core, Tensor=ov.Tensor))
    graph = _graph(tmp_path)
    with caplog.at_level(logging.WARNING, logger=runner_module.__name__):
        runner = runner_module.OpenVINORunner(graph, "hidden", "float32", "none", threads=1,
                                              compile_cache=tmp_path / "compiled")
    feed = {"input_ids": np.full((2, 3), 5, np.int64), "attention_mask": np.ones((2, 3), np.int64)}
    assert runner._run(feed).tolist() == [[5.0] * 3] * 2  # noqa: SLF001
    assert "compiling without it" in caplog.text
    # Without a compile cache, a failing compile still fails the load, naming the graph.
    monkeypatch.setattr(Core, "compile_model", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("bad")))
    with pytest.raises(runner_module.BackendError, match="OpenVINO cannot read or compile .*g.xml"):
        runner_module.OpenVINORunner(graph, "hidden", "float32", "none", threads=1)


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_a_graph_whose_weights_are_cut_short_is_a_backend_error(tmp_path: Path, dtype: str) -> None:
    """mixed reads the graph itself before compiling it (to mark what stays in float32): a model.bin cut short
    failed there with a bare RuntimeError, past the load's error handling (`inferd prepare` printed a traceback)."""
    import openvino as ov
    import openvino.opset13 as ops

    from inferd.core.backends import openvino as runner_module

    ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    weights = ops.constant(np.arange(4096, dtype=np.float32).reshape(64, 64))
    hidden = ops.matmul(ops.convert(ops.unsqueeze(ids, 2), ov.Type.f32), ops.reshape(weights, [1, 4096], False),
                        False, False)
    ov.save_model(ov.Model([hidden], [ids]), tmp_path / "g.xml", compress_to_fp16=False)
    with (tmp_path / "g.bin").open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(runner_module.BackendError, match="OpenVINO cannot read or compile .*g.xml"):
        runner_module.OpenVINORunner(tmp_path / "g.xml", "hidden", dtype, "none", threads=1)
