"""``inferd bench`` on the runtime install (no matplotlib: a dev requirement) says so before it measures, and
writes its figures without the plot (issue 39: it measured for minutes, then died writing the plot)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from inferd.bench import run as bench_run


def test_without_matplotlib_the_run_says_so_first_and_writes_its_figures(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as on the runtime install
    said_before: list[str] = []
    real = bench_run.run_phases

    def spied(args: Any, command: str) -> dict[str, Any]:
        said_before.append(capsys.readouterr().err)
        return real(args, command)

    monkeypatch.setattr(bench_run, "run_phases", spied)
    # A phase that fails at once (its server refuses its settings) keeps the run short; its report is written.
    rc = bench_run.main(["--quick", "--model", str(tiny_model), "--out", str(tmp_path), "--logs", str(tmp_path),
                         "--phases", "closed", "--server-env", "INFERD__BATCHING__MAX_BATCH_SIZE=-1"])
    assert rc == 1
    assert len(said_before) == 1 and "matplotlib cannot be imported" in said_before[0]
    assert "plots skipped" in said_before[0]
    results = json.loads((tmp_path / "results.json").read_text())
    assert "plot" not in results["files"] and "inferd" in results["phases"]
    assert "Plot: `not written`" in (tmp_path / "RESULTS.md").read_text()
    assert not (tmp_path / "latency_throughput.png").exists()
