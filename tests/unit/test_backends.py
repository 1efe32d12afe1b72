"""Backend options, dtype choice, the gate's arithmetic and verdict, the cache key: no graphs, no weights."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from settingskit import make_settings

from inferd.core.agreement import cosine_rows, overlap_at_k
from inferd.core.backends import factory, gate, gate_figures, gate_inputs, gate_shapes, gate_verdict
from inferd.core.backends.base import (
    INT8_BF16_FIRST,
    BackendError,
    BackendOptions,
    check_options,
    cpu_flags,
    gate_kind,
    options_for,
    resolve_dtype,
)
from inferd.core.spec import spec_from_settings
from inferd.settings import GateSettings, Settings

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
BF16 = {"avx2", "avx512f", "avx512_bf16"}
NO_BF16 = {"avx2", "avx512f"}


# -- dtype ------------------------------------------------------------------------------------------------


def test_auto_picks_bf16_only_on_a_cpu_with_native_bf16() -> None:
    dtype, why = resolve_dtype("auto", "openvino", CPU, BF16)
    assert dtype == "bfloat16" and "avx512_bf16" in why
    assert resolve_dtype("auto", "torch", CPU, {"amx_bf16"})[0] == "bfloat16"
    dtype, why = resolve_dtype("auto", "openvino", CPU, NO_BF16)
    assert dtype == "float32" and "no native bf16" in why


def test_auto_tries_bf16_float_parts_for_static_int8_only_on_openvino_with_native_bf16() -> None:
    dtype, why = resolve_dtype("auto", "openvino", CPU, BF16, quantize="int8")
    assert dtype == "bfloat16" and INT8_BF16_FIRST in why and "avx512_bf16" in why  # the gate decides, see export
    dtype, why = resolve_dtype("auto", "openvino", CPU, NO_BF16, quantize="int8")
    assert dtype == "float32" and "static int8" in why and INT8_BF16_FIRST not in why
    dtype, why = resolve_dtype("auto", "onnx", CPU, BF16, quantize="int8")
    assert dtype == "float32" and INT8_BF16_FIRST not in why
    assert resolve_dtype("auto", "openvino", CPU, BF16, quantize="int8-weights")[0] == "bfloat16"


def test_auto_is_float16_on_cuda_and_float32_for_onnx_runtime() -> None:
    assert resolve_dtype("auto", "torch", CUDA, NO_BF16)[0] == "float16"
    dtype, why = resolve_dtype("auto", "onnx", CPU, BF16)
    assert dtype == "float32" and "ONNX Runtime" in why


@pytest.mark.parametrize(("dtype", "backend", "words"), [
    ("float16", "openvino", "float16 is for CUDA"),
    ("float16", "onnx", "float16 is for CUDA"),
    ("bfloat16", "onnx", "no bf16 kernels"),
    ("int4", "torch", "choose one of"),
])
def test_impossible_dtypes_are_refused_with_the_setting_named(dtype: str, backend: str, words: str) -> None:
    with pytest.raises(BackendError, match=words) as err:
        resolve_dtype(dtype, backend, CPU, BF16)
    assert "model.dtype" in str(err.value)


def test_explicit_dtypes_are_kept() -> None:
    assert resolve_dtype("bfloat16", "openvino", CPU, BF16) == ("bfloat16", "configured")
    # Without native bf16 OpenVINO's plugin would compile float32 under a bf16 label: it is float32, said why.
    dtype, why = resolve_dtype("bfloat16", "openvino", CPU, NO_BF16)
    assert dtype == "float32" and "no native bf16" in why and "OpenVINO runs float32" in why
    assert resolve_dtype("bfloat16", "torch", CPU, NO_BF16) == ("bfloat16", "configured")  # torch emulates it
    assert resolve_dtype("float16", "torch", CUDA, set()) == ("float16", "configured")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512_bf16 amx_tile\nbugs\t\t: spectre\n")
    assert cpu_flags(info) == {"fpu", "sse", "avx512_bf16", "amx_tile"}
    assert cpu_flags(tmp_path / "missing") == set()


# -- options ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "words"), [
    (BackendOptions(backend="tensorrt"), "model.backend 'tensorrt'"),
    (BackendOptions(backend="torch", quantize="int8"), "needs model.backend onnx or openvino"),
    (BackendOptions(backend="onnx", quantize="int8-weights"), "OpenVINO's"),
    (BackendOptions(backend="openvino", quantize="int4"), "model.quantize 'int4'"),
    (BackendOptions(unpadded="maybe"), "model.unpadded 'maybe'"),
    (BackendOptions(backend="onnx", unpadded="true"), "model.unpadded true is the torch backend's"),
])
def test_option_combinations_that_cannot_work_are_refused(options: BackendOptions, words: str) -> None:
    with pytest.raises(BackendError, match=words):
        check_options(options, CPU)


def test_converted_backends_refuse_a_gpu_device() -> None:
    with pytest.raises(BackendError, match="model.device cuda"):
        check_options(BackendOptions(backend="openvino"), CUDA)
    check_options(BackendOptions(backend="torch"), CUDA)  # torch runs anywhere


def test_settings_reach_the_backend_options(tmp_path: Path) -> None:
    settings = make_settings(layered="dev", model={"backend": "openvino", "quantize": "int8", "dtype": "auto",
                                                   "cache_dir": str(tmp_path),
                                                   "gate": {"int8_cosine_min": 0.98, "texts": 64}})
    options = options_for(spec_from_settings(settings))
    assert (options.backend, options.quantize, options.dtype) == ("openvino", "int8", "auto")
    assert options.cache_dir == tmp_path
    assert options.gate.int8_cosine_min == 0.98
    assert options.gate.int8_overlap_at_10 == GateSettings().int8_overlap_at_10
    assert (options.gate.texts, options.gate.calibration_texts) == (64, 300)


def test_bad_backend_settings_name_the_key() -> None:
    from inferd.config import ConfigError

    with pytest.raises(ConfigError, match="model.backend"):
        make_settings(layered="dev", model={"backend": "tensorrt"})
    with pytest.raises(ConfigError, match="model.gate.int8_cosine_min"):
        make_settings(layered="dev", **{"model.gate.int8_cosine_min": 1.5})


def test_unpadded_reaches_the_options_as_auto_true_or_false() -> None:
    def options(**overrides: object) -> BackendOptions:
        return options_for(spec_from_settings(make_settings(layered="dev", **overrides)))

    assert options().unpadded == "auto"
    assert options(**{"model.unpadded": True}).unpadded == "true"
    assert options(**{"model.unpadded": False}).unpadded == "false"
    env = make_settings(layered="dev", environ={"INFERD__MODEL__UNPADDED": "false"})
    assert options_for(spec_from_settings(env)).unpadded == "false"
    check_options(BackendOptions(backend="onnx", unpadded="auto"), CPU)  # auto leaves the graph runtimes be


def test_a_bad_unpadded_setting_names_the_key() -> None:
    from inferd.config import ConfigError

    with pytest.raises(ConfigError, match="model.unpadded"):
        make_settings(layered="dev", model={"unpadded": "sometimes"})


def test_every_runner_says_whether_padding_costs_compute() -> None:
    """The scheduler's padding floor follows the runner's ``capabilities.pads``: eager torch and both graph runtimes
    run every row to the batch's longest text; the unpadded torch runner computes real tokens only (test_varlen.py
    shows it)."""
    from inferd.core.backends.base import Runner
    from inferd.core.backends.onnx import OnnxRunner
    from inferd.core.backends.openvino import OpenVINORunner
    from inferd.core.backends.torch import TorchRunner
    from inferd.core.backends.varlen import VarlenRunner

    assert "capabilities" in Runner.__annotations__
    assert {c.__name__: c.capabilities.pads for c in (TorchRunner, OnnxRunner, OpenVINORunner, VarlenRunner)} == {
        "TorchRunner": True, "OnnxRunner": True, "OpenVINORunner": True, "VarlenRunner": False}


def test_defaults_keep_torch_fp32() -> None:
    m = Settings().model
    assert (m.backend, m.dtype, m.quantize) == ("torch", "float32", "none")


# -- the gate's figures and verdict -----------------------------------------------------------------------


def test_cosines_and_neighbour_overlap() -> None:
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(40, 8))
    assert np.allclose(cosine_rows(ref, 3 * ref), 1.0)
    assert overlap_at_k(ref, ref) == 1.0
    # Rows shuffled: each text's neighbours become unrelated texts.
    assert overlap_at_k(ref, ref[rng.permutation(40)]) < 0.5
    noisy = ref + rng.normal(scale=0.05, size=ref.shape)
    assert 0.5 < overlap_at_k(ref, noisy) < 1.0


def figures(cos_min: float, cos_mean: float, overlap: float) -> gate_figures.GateFigures:
    return gate_figures.GateFigures(cos_min, cos_mean, overlap, 1.0, 256, {"1": {"cosine_min": cos_min}})


def test_each_kind_has_its_thresholds() -> None:
    assert gate_kind("float32", "none") == "fp32"
    assert gate_kind("bfloat16", "none") == "half"
    assert gate_kind("float16", "none") == "half"
    assert gate_kind("bfloat16", "int8") == "int8"
    t = GateSettings()
    assert gate_verdict.judge(figures(0.99995, 0.99999, 0.99), "fp32", t) == []
    assert gate_verdict.judge(figures(0.9998, 0.99999, 1.0), "fp32", t) == [
        "cosine min 0.999800 < 0.9999 (model.gate.fp32_cosine_min)"]
    assert gate_verdict.judge(figures(0.9998, 0.9999, 0.97), "half", t) == []
    assert gate_verdict.judge(figures(0.9994, 0.9999, 0.97), "half", t)


def test_int8_is_judged_on_min_mean_and_overlap_with_every_failure_named() -> None:
    t = GateSettings()
    assert gate_verdict.judge(figures(0.9935, 0.998, 0.952), "int8", t) == []
    failures = gate_verdict.judge(figures(0.976, 0.993, 0.903), "int8", t)
    assert failures == ["cosine min 0.976000 < 0.99 (model.gate.int8_cosine_min)",
                        "cosine mean 0.993000 < 0.995 (model.gate.int8_cosine_mean)",
                        "overlap@10 0.903000 < 0.95 (model.gate.int8_overlap_at_10)"]
    assert gate_verdict.judge(figures(0.976, 0.993, 0.903), "int8",
                      GateSettings(int8_cosine_min=0.97, int8_cosine_mean=0.99, int8_overlap_at_10=0.9)) == []


def test_figures_survive_the_cache_round_trip() -> None:
    f = figures(0.99, 0.995, 0.96)
    assert gate_figures.GateFigures.from_dict(json.loads(json.dumps(f.as_dict()))) == f


def test_the_summary_prints_the_figures_its_rules_judge_and_no_other() -> None:
    """A figure no rule judges read as a pass whatever its value: ``batch invariance min nan`` was printed in a
    passed gate's summary."""
    f = gate_figures.GateFigures(0.99, 0.995, 0.96, float("nan"), 256, {"1": {"cosine_min": 0.99}})
    t = GateSettings()
    int8 = gate_verdict.summary(f, "int8", t)
    assert "cosine min 0.990000 (≥ 0.99)" in int8 and "overlap@10 0.960000 (≥ 0.95)" in int8
    assert "cosine mean 0.995000 (≥ 0.995)" in int8 and "non-finite outputs 0 (must be 0)" in int8
    half = gate_verdict.summary(f, "half", t)
    assert "cosine min 0.990000 (≥ 0.9995)" in half and "overlap" not in half and "mean" not in half
    assert "invariance" not in int8 + half and "nan" not in int8 + half


def test_a_nan_figure_is_no_pass() -> None:
    t = GateSettings(int8_cosine_min=0.0, int8_cosine_mean=0.0, int8_overlap_at_10=0.0)
    nan = float("nan")
    assert gate_verdict.judge(figures(nan, 0.999, 0.99), "fp32", GateSettings()) == [
        "cosine min nan < 0.9999 (model.gate.fp32_cosine_min)"]
    assert gate_verdict.judge(figures(0.999, 0.999, nan), "int8", t) == [
        "overlap@10 nan < 0.0 (model.gate.int8_overlap_at_10)"]
    scores = gate_figures.ScoreFigures("rerank", 1.0, 1.0, None, nan, 0.0, 256, {})
    assert gate_verdict.judge(scores, "fp32", t) == ["max diff nan > 0.001 (model.gate.fp32_score_diff_max)"]


def test_a_refusal_says_wrong_graph_or_less_precise() -> None:
    t = GateSettings()
    assert gate_verdict.cause(figures(0.99999, 0.99999, 1.0), "fp32", t) is None
    # float32 rounds as torch does: any failure is another computation.
    assert gate_verdict.cause(figures(0.9990, 0.9999, 1.0), "fp32", t).startswith("wrong graph: a float32 graph")
    # Half precision slightly off: less precise; far off: wrong whatever the precision.
    assert gate_verdict.cause(figures(0.9990, 0.9999, 0.99), "half", t).startswith("less precise than the bound")
    assert gate_verdict.cause(figures(0.30, 0.9, 0.5), "int8", t).startswith("wrong graph: cosine min 0.300000 < 0.5")
    rerank = gate_figures.ScoreFigures("rerank", 0.16, 0.3, None, 0.9, 0.0, 256, {})
    assert gate_verdict.cause(rerank, "half", t).startswith("wrong graph: Spearman mean 0.160000 < 0.5")


def test_builtin_texts_are_multilingual_distinct_and_seeded() -> None:
    texts = gate_inputs.builtin_texts(200)
    assert len(set(texts)) == 200 and texts == gate_inputs.builtin_texts(200)
    assert any("的" in t for t in texts) and any(t.isascii() for t in texts)
    assert set(texts).isdisjoint(gate_inputs.builtin_texts(200, gate_inputs.CALIBRATION_SEED))


def test_calibration_file_lines_and_json_lines(tmp_path: Path) -> None:
    f = tmp_path / "cal.txt"
    f.write_text("\n".join([f"plain text {i}" for i in range(15)] + [""] +
                           [json.dumps({"text": f"json text {i}"}) for i in range(10)]))
    texts = gate_inputs.read_calibration_file(f)
    assert len(texts) == 25 and texts[0] == "plain text 0" and texts[-1] == "json text 9"


@pytest.mark.parametrize(("content", "words"), [
    ("one\ntwo\n", "holds 2 texts"),
    ('{"txt": "x"}\n' * 30, "line 1: not a JSON object with a 'text'"),
    ('{"text": ""}\n' * 30, "line 1: 'text' must be a non-empty string"),
])
def test_bad_calibration_files_are_refused(tmp_path: Path, content: str, words: str) -> None:
    f = tmp_path / "cal.txt"
    f.write_text(content)
    with pytest.raises(BackendError, match=words):
        gate_inputs.read_calibration_file(f)
    with pytest.raises(BackendError, match="model.calibration_file"):
        gate_inputs.read_calibration_file(tmp_path / "missing.txt")


# -- the cache key ----------------------------------------------------------------------------------------


def test_folder_digest_follows_content_not_timestamps(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(b"\x00" * 10)
    first = factory.folder_digest(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # rewritten, same bytes
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "lock").write_text("x")  # hidden: the hub's lock files do not count
    assert factory.folder_digest(tmp_path) == first
    (tmp_path / "sub" / "w.bin").write_bytes(b"\x00" * 9 + b"\x01")
    assert factory.folder_digest(tmp_path) != first


def test_every_option_that_changes_the_graph_changes_the_entry(tmp_path: Path) -> None:
    base = BackendOptions(backend="openvino")

    def folder(options: BackendOptions = base, dtype: str = "float32", digest: str = "d", limit: int = 128,
               calibration: str = "builtin:1", flags: frozenset[str] = frozenset({"avx2", "avx512f"})) -> Path:
        return factory.entry_folder(tmp_path, factory.entry_key(digest, options, dtype, limit, calibration,
                                                              set(flags)))

    first = folder()
    assert first == folder()
    assert first.parent == tmp_path and first.name.startswith("embedding-openvino-none-float32-")
    # The task and its head: a cross-encoder's logits graph and its gate are not an encoder's.
    rerank = folder(BackendOptions(task="rerank", head="logits", backend="openvino"))
    assert rerank.name.startswith("rerank-openvino-none-float32-")
    others = [rerank, folder(BackendOptions(task="classification", head="logits", backend="openvino")),
              folder(dtype="bfloat16"), folder(digest="e"), folder(limit=256), folder(calibration="file:ab"),
              folder(BackendOptions(backend="openvino", quantize="int8")), folder(BackendOptions(backend="onnx")),
              folder(BackendOptions(backend="openvino", gate=GateSettings(texts=64))),
              # Another CPU kind runs other kernels (int8 dot products, native bf16): judged again.
              folder(flags=frozenset({"avx2", "avx512f", "avx512_vnni"})), folder(flags=frozenset({"avx2"}))]
    assert len({first, *others}) == len(others) + 1
    # Flags that pick no kernel do not split the cache.
    assert folder(flags=frozenset({"avx2", "avx512f", "sse4_2", "rdrand"})) == first
    # Thresholds are not in the key: stored figures are judged against the current ones.
    assert folder(BackendOptions(backend="openvino", gate=GateSettings(fp32_cosine_min=0.5))) == first


def test_static_int8_without_int8_dot_products_is_warned_about() -> None:
    from inferd.core.backends.base import kernel_flags, quantize_warning

    warning = quantize_warning("int8", {"avx2", "fma", "avx512f"})
    assert warning is not None and "avx512_vnni, avx_vnni or amx_int8" in warning and "int8-weights" in warning
    for dot in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert quantize_warning("int8", {"avx2", dot}) is None
    # Weight-only int8 computes in floating point: nothing saturates.
    assert quantize_warning("int8-weights", {"avx2"}) is None and quantize_warning("none", set()) is None
    assert kernel_flags({"fpu", "avx2", "amx_bf16", "avx_vnni", "sse"}) == ["amx_bf16", "avx2", "avx_vnni"]


def test_library_versions_are_part_of_the_key() -> None:
    versions = factory.versions("openvino")
    assert set(versions) == {"torch", "transformers", "openvino", "nncf"}
    assert all(v != "missing" for v in versions.values())
    assert set(factory.versions("onnx")) == {"torch", "transformers", "onnx", "onnxruntime"}


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert factory.default_cache_dir() == tmp_path / "inferd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert factory.default_cache_dir() == Path.home() / ".cache" / "inferd"


def test_an_entry_of_another_format_is_not_read(tmp_path: Path) -> None:
    (tmp_path / factory.META).write_text(json.dumps({"format": factory.FORMAT + 1}))
    assert factory.check_entry(tmp_path)[0] is None
    (tmp_path / factory.META).write_text("{half")
    assert factory.check_entry(tmp_path)[0] is None
    # Of this format but recording no files: nothing to check its graph against.
    (tmp_path / factory.META).write_text(json.dumps({"format": factory.FORMAT, "graph": "model.xml"}))
    assert factory.check_entry(tmp_path) == (None, "meta.json records no files")
    whole = {"format": factory.FORMAT, "graph": "model.xml", "files": {}}
    (tmp_path / factory.META).write_text(json.dumps(whole))
    assert factory.check_entry(tmp_path) == (whole, None)


class WordProbe:
    """A tokenizer of whitespace words plus [CLS]/[SEP], truncating or refusing past the limit."""

    task = "embedding"
    max_seq_length = 20

    def __init__(self, truncate: bool) -> None:
        self.truncate = truncate
        self.seen: list[str] = []

    def preprocess(self, texts: list[str]) -> list:
        from inferd.core.preprocess import Encoded, InputError

        self.seen.extend(texts)
        words = texts[0].split()
        if len(words) + 2 > self.max_seq_length:
            if not self.truncate:
                raise InputError(0, "too long")
            return [Encoded(list(range(self.max_seq_length)), True)]
        return [Encoded(list(range(len(words) + 2)), False)]


@pytest.mark.parametrize("truncate", [True, False])
def test_texts_at_the_limit_are_long_documents_of_distinct_texts(truncate: bool) -> None:
    probe = WordProbe(truncate)
    texts = [f"text number {i}" for i in range(10)]
    item = gate_inputs.at_limit(probe, texts, 3)
    assert item.tokens == probe.max_seq_length
    document = probe.seen[0]
    assert document.startswith("text number 3 text number 4 text number 5")
    encoded = gate_inputs.encode_set(probe, texts * 2)
    assert encoded[gate_inputs.AT_LIMIT_SHARE - 1].tokens == probe.max_seq_length
    assert [e.tokens for e in encoded[:3]] == [5, 5, 5]


def test_long_documents_stop_at_the_gates_length_on_a_long_context_model() -> None:
    """An 8,192-token model is judged on documents of LONG_TOKENS, not its maximum (truncating or refusing)."""
    texts = [f"text number {i}" for i in range(300)]
    for truncate in (True, False):
        probe = WordProbe(truncate)
        probe.max_seq_length = 8192
        assert gate_inputs.at_limit(probe, texts, 3).tokens == gate_inputs.LONG_TOKENS


class VectorProbe:
    """Whitespace words as ids (truncated at the limit); a runner is a function of the batch's inputs."""

    task = "embedding"
    outputs = ("dense",)

    def __init__(self, max_seq_length: int) -> None:
        self.max_seq_length = max_seq_length

    def preprocess(self, texts: list[str]) -> list:
        from inferd.core.preprocess import Encoded

        out = []
        for text in texts:
            ids = [1, *(zlib.crc32(w.encode()) % 1000 + 3 for w in text.split()), 2]
            out.append(Encoded(ids[: self.max_seq_length], len(ids) > self.max_seq_length))
        return out

    def forward(self, runner, batch: list) -> np.ndarray:  # type: ignore[no-untyped-def]
        return runner(batch)


TABLE = np.random.default_rng(0).normal(size=(1003, 16))


class Recording:
    """A model: each input's vector the mean of its ids' rows, whatever it is batched with; every batch's
    padded size is kept, and ``nan_for`` answers NaN for one input in batches of ``nan_rows`` rows."""

    def __init__(self, nan_for: list[int] | None = None, nan_rows: int = 0) -> None:
        self.nan_for, self.nan_rows = nan_for, nan_rows
        self.padded: list[tuple[int, int]] = []

    def __call__(self, batch: list) -> np.ndarray:
        self.padded.append((len(batch), max(e.tokens for e in batch)))
        rows = np.stack([TABLE[e.ids].mean(axis=0) for e in batch])
        for r, e in enumerate(batch):
            if e.ids == self.nan_for and len(batch) == self.nan_rows:
                rows[r, 3] = np.nan
        return rows


def test_a_nan_for_one_text_in_one_batch_shape_fails_the_gate_as_a_wrong_graph() -> None:
    probe = VectorProbe(64)
    texts = gate_inputs.builtin_texts(64)
    # A text the padded shape runs (the costly shapes run on a subset of the inputs: gate_shapes.subset).
    one = probe.preprocess([texts[gate_shapes.subset(len(texts), gate_shapes.PADDED)[1]]])[0].ids
    figures = gate.measure(probe, Recording(), Recording(one, nan_rows=8), texts)
    # Only the padded shape (batches of 8) saw it; every other shape agrees exactly.
    assert figures.nonfinite == 1 and figures.shapes[gate_shapes.PADDED]["nonfinite"] == 1
    assert figures.shapes["1"]["cosine_min"] == pytest.approx(1.0)
    for kind in ("fp32", "half", "int8"):
        loosest = GateSettings(fp32_cosine_min=0.0, half_cosine_min=0.0, int8_cosine_min=0.0, int8_cosine_mean=0.0,
                               int8_overlap_at_10=0.0)
        failures = gate_verdict.judge(figures, kind, loosest)
        assert failures and failures[0] == (
            f"1 outputs are not finite (NaN or infinity) in batch shapes {gate_shapes.PADDED}")
        assert gate_verdict.cause(figures, kind, loosest).startswith("wrong graph: it answers NaN or infinity")
    assert "non-finite outputs 1 (must be 0)" in gate_verdict.summary(figures, "fp32", GateSettings())
    # The same runner without the NaN passes.
    assert gate_verdict.judge(gate.measure(probe, Recording(), Recording(), texts), "fp32", GateSettings()) == []


def test_the_gate_costs_its_own_texts_not_the_models_maximum_length() -> None:
    """On an 8,192-token model every batch the gate runs is padded to its own longest input, at most
    LONG_TOKENS: what it ran is counted in its figures, and that count is what the runners saw."""
    texts = gate_inputs.builtin_texts(64)
    reference, candidate = Recording(), Recording()
    figures = gate.measure(VectorProbe(8192), reference, candidate, texts)
    ran = reference.padded + candidate.padded
    assert figures.ran == {"batches": len(ran), "padded_tokens": sum(rows * longest for rows, longest in ran),
                           "longest": max(longest for _, longest in ran)}
    assert figures.ran["longest"] == gate_inputs.LONG_TOKENS
    # Five passes over 64 texts (the reference's and four shapes), a filler row per seven: short texts
    # padded to a long one cost most, and the whole stays within what 64 x 6 long documents would.
    assert figures.ran["padded_tokens"] <= 6 * len(texts) * gate_inputs.LONG_TOKENS
    assert max(rows * longest for rows, longest in ran) <= 32 * gate_inputs.LONG_TOKENS


def test_an_entry_s_lock_clears_the_work_folders_a_dead_builder_left_and_nothing_else(tmp_path: Path) -> None:
    """A build's work folder (``.<entry>.<random>``) exists only while its builder holds the entry's lock: one
    found by the next holder is a killed builder's, a graph's copy that nothing would ever remove."""
    entry = tmp_path / "embedding-openvino-x"
    for leftover in (".embedding-openvino-x.k2j4h1", ".embedding-openvino-x.broken-9f8e"):
        (tmp_path / leftover / "export").mkdir(parents=True)
        (tmp_path / leftover / "export" / "model.bin").write_bytes(b"\0" * 64)
    other = tmp_path / ".embedding-openvino-y.k2j4h1"  # another entry's work: not this lock's to clear
    other.mkdir()
    entry.mkdir()
    with factory.entry_lock(entry):
        left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".embedding-openvino-x.lock", ".embedding-openvino-y.k2j4h1", "embedding-openvino-x"]
