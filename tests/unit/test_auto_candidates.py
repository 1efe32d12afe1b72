"""backend auto's choice without a model: which candidates a machine offers and why the others are not tried, the
judge's walk over them (refused, busy, passed, what is left) against a fake switch, and the choice a warm start
adopts (kept per device, and only while its cache entry is whole)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from inferd.core.backends import factory
from inferd.core.backends.auto import ALL, AutoUpgrade, ModelChangeBusy, candidates, remember, remembered
from inferd.core.backends.gate_verdict import LESS_PRECISE, WRONG_GRAPH
from inferd.core.spec import ModelSpec
from inferd.settings import AUTO_CANDIDATES

AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni"}
ZEN3 = {"avx2"}


def names(flags: set[str], **kw: object) -> tuple[list[str], dict[str, str]]:
    todo, skipped = candidates(flags, openvino_installed=True, **kw)  # type: ignore[arg-type]
    return [c.name for c in todo], skipped


def test_the_machine_decides_the_candidates_fastest_first() -> None:
    assert names(AMX, cuda=False)[0] == ["openvino-mixed", "openvino-bfloat16", "openvino-float32-int8",
                                         "openvino-float32"]
    todo, skipped = names(ZEN3, cuda=False)
    assert todo == ["openvino-float32"]
    assert "no native bf16" in skipped["openvino-bfloat16"] and "no native bf16" in skipped["openvino-mixed"]
    assert "no int8 dot products" in skipped["openvino-float32-int8"]
    todo, skipped = names(AMX, cuda=True)
    assert todo == ["torch-float16"] and skipped["openvino-float32"].startswith("the model runs on a GPU")
    todo, skipped = candidates(AMX, cuda=False, openvino_installed=False)
    assert todo == [] and "openvino package is not installed" in skipped["openvino-float32"]


def test_auto_candidates_narrow_and_order_the_choice_and_refuse_an_unknown_name() -> None:
    todo, skipped = names(AMX, cuda=False, wanted=("openvino-float32", "openvino-bfloat16"))
    assert todo == ["openvino-float32", "openvino-bfloat16"]
    assert skipped["openvino-float32-int8"] == "not in model.auto_candidates"
    # A candidate this machine cannot run keeps the machine's reason, wanted or not.
    assert "no native bf16" in names(ZEN3, cuda=False, wanted=("openvino-bfloat16",))[1]["openvino-bfloat16"]
    with pytest.raises(ValueError, match=r"model.auto_candidates \['onnx-float32'\]: choose among"):
        names(AMX, cuda=False, wanted=("onnx-float32",))


def test_the_judge_takes_the_first_candidate_that_passes_retrying_while_another_change_loads() -> None:
    calls: list[str] = []
    busy = [True]

    def switch(runtime: dict[str, str]) -> None:
        name = f"{runtime['backend']}-{runtime['dtype']}-{runtime['quantize']}"
        calls.append(name)
        if runtime["dtype"] in ("bfloat16", "mixed"):
            raise RuntimeError(f"openvino {runtime['dtype']} refused by the accuracy gate (half thresholds)")
        if busy[0]:
            busy[0] = False
            raise ModelChangeBusy("another model change is in progress")

    auto = AutoUpgrade(flags=AMX, openvino_installed=True)
    auto.start("torch-float32", switch)
    assert auto.wait(30)
    said = auto.describe()
    states = {c["candidate"]: (c["state"], c["reason"]) for c in said["candidates"]}
    assert said["serving"] == "openvino-float32-int8" and said["state"] == "done"
    assert states["openvino-bfloat16"][0] == "refused" and "accuracy gate" in states["openvino-bfloat16"][1]
    assert states["openvino-float32-int8"] == ("serving", None)
    assert states["openvino-float32"] == ("skipped", "openvino-float32-int8 passed first (faster)")
    # The busy candidate was tried again, not refused; nothing after the one that passed was tried.
    assert states["openvino-mixed"][0] == "refused"
    assert calls == ["openvino-mixed-none", "openvino-bfloat16-none", "openvino-float32-int8", "openvino-float32-int8"]


def test_nothing_passes_and_torch_stays_and_a_served_runtime_is_not_judged() -> None:
    def refuse(runtime: dict[str, str]) -> None:
        raise RuntimeError("refused by the accuracy gate")

    auto = AutoUpgrade(flags=ZEN3, openvino_installed=True)
    auto.start("torch-float32", refuse)
    assert auto.wait(30) and auto.describe()["serving"] == "torch-float32"
    assert {c["state"] for c in auto.describe()["candidates"]} == {"refused", "skipped"}
    gpu = AutoUpgrade(flags=AMX, openvino_installed=True)
    gpu.start("torch-float16", lambda runtime: pytest.fail("switched to the runtime it serves"), cuda=True)
    assert gpu.wait(5) and gpu.describe()["state"] == "done"
    assert {c["candidate"]: c["reason"] for c in gpu.describe()["candidates"]}["torch-float16"] == "serving already"


@pytest.mark.parametrize(("cause", "bf16_judged"), [(LESS_PRECISE, False), (WRONG_GRAPH, True)])
def test_mixed_refused_as_less_precise_settles_plain_bf16_without_judging_it(cause: str, bf16_judged: bool) -> None:
    """Plain bf16 rounds all mixed rounds and more: once mixed is refused for its rounding, judging bf16 is a
    minute of a cold start spent on a known answer. A mixed graph refused as a wrong graph says nothing of bf16."""
    calls: list[str] = []

    def switch(runtime: dict[str, str]) -> None:
        calls.append(f"{runtime['backend']}-{runtime['dtype']}")
        if runtime["dtype"] in ("mixed", "bfloat16"):
            raise RuntimeError(f"openvino {runtime['dtype']} refused by the accuracy gate: {cause}: ...")

    auto = AutoUpgrade(flags=AMX, openvino_installed=True)
    auto.start("torch-float32", switch)
    assert auto.wait(30)
    states = {c["candidate"]: (c["state"], c["reason"]) for c in auto.describe()["candidates"]}
    assert auto.describe()["serving"] == "openvino-float32-int8"
    assert ("openvino-bfloat16" in calls) is bf16_judged
    if bf16_judged:
        assert states["openvino-bfloat16"][0] == "refused"
    else:
        assert states["openvino-bfloat16"] == (
            "skipped", f"openvino-mixed was refused as {LESS_PRECISE}; plain bf16 rounds what it rounds and more")


def test_the_candidates_settings_accept_are_the_ones_auto_knows() -> None:
    assert tuple(c.name for c in ALL) == AUTO_CANDIDATES


def test_a_judging_that_cannot_start_or_fails_midway_is_logged_not_lost(caplog: pytest.LogCaptureFixture) -> None:
    """``start`` runs in the first load's thread, under a task nobody awaits, and the judging in a thread of its own:
    an exception of either would vanish (or reach stderr only) while torch serves on without a word."""
    unknown = AutoUpgrade(wanted=("openvino-foo",), flags=AMX, openvino_installed=True)
    with caplog.at_level(logging.ERROR, logger="inferd.core.backends.auto"):
        unknown.start("torch-float32", lambda runtime: pytest.fail("judged an unknown candidate"))
    assert "model.auto_candidates ['openvino-foo']" in caplog.text
    assert unknown.describe()["state"] == "done" and unknown.describe()["serving"] == "torch-float32"

    def listener(verdicts: list) -> None:
        if threading.current_thread().name == "inferd-auto":
            raise RuntimeError("the metrics broke")

    broken = AutoUpgrade(flags=ZEN3, on_verdict=listener, openvino_installed=True)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="inferd.core.backends.auto"):
        broken.start("torch-float32", lambda runtime: None)
        assert broken.wait(30)
    assert "the judging stopped on an error" in caplog.text and "the metrics broke" in caplog.text
    assert broken.describe()["serving"] == "torch-float32"


def whole_entry(folder: Path) -> Path:
    """A cache entry as factory.build leaves it: a graph file and a meta.json recording it."""
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(bytes(range(256)) * 64)
    meta = {"format": factory.FORMAT, "graph": "model.bin", "files": factory.manifest(folder)}
    (folder / factory.META).write_text(json.dumps(meta))
    return folder


def test_a_remembered_choice_whose_entry_is_damaged_is_not_adopted(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A warm start would load the damaged graph in the foreground: it starts on torch instead, and the judging
    builds the entry again."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    spec = ModelSpec(tmp_path / "model", "1", backend="auto", device="cpu", cache_dir=str(tmp_path / "cache"))
    entry = whole_entry(tmp_path / "cache" / "embedding-openvino-none-float32-x")
    remember(spec, "openvino-float32", str(entry))
    assert remembered(spec) == "openvino-float32"
    data = bytearray((entry / "model.bin").read_bytes())
    data[100] ^= 0xFF  # same size, one byte other
    (entry / "model.bin").write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="inferd.core.backends.auto"):
        assert remembered(spec) is None
    assert f"its cache entry {entry} is broken (model.bin is not the file written" in caplog.text
    (entry / factory.META).write_text('{"format": ')  # cut short
    assert remembered(spec) is None


def test_the_remembered_choice_is_the_devices_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU node sharing a cache prepared on a CPU one would otherwise start on the CPU's OpenVINO choice."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")

    def spec(device: str) -> ModelSpec:
        return ModelSpec(tmp_path / "model", "1", backend="auto", device=device, cache_dir=str(tmp_path / "cache"))

    entry = whole_entry(tmp_path / "cache" / "embedding-openvino-none-float32-x")
    remember(spec("cpu"), "openvino-float32", str(entry))
    assert remembered(spec("cpu")) == "openvino-float32"
    assert remembered(spec("cuda")) is None
    # device auto is the device the load resolves it to.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert remembered(spec("auto")) == "openvino-float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert remembered(spec("auto")) is None


def test_a_remembered_choice_follows_its_cache_to_another_path(tmp_path: Path) -> None:
    """A cache prepared at one path (an image build's, ``inferd prepare`` on a host) and mounted at another (a pod's
    volume) starts warm: the choice names its entry from the cache's root."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")

    def spec(cache: Path) -> ModelSpec:
        return ModelSpec(tmp_path / "model", "1", backend="auto", device="cpu", cache_dir=str(cache))

    entry = whole_entry(tmp_path / "built" / "embedding-openvino-none-float32-x")
    remember(spec(tmp_path / "built"), "openvino-float32", str(entry))
    (tmp_path / "built").rename(tmp_path / "mounted")
    assert remembered(spec(tmp_path / "mounted")) == "openvino-float32"
    # The entry gone from the new place: no adoption.
    (tmp_path / "mounted" / entry.name / "model.bin").unlink()
    assert remembered(spec(tmp_path / "mounted")) is None
