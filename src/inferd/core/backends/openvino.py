"""OpenVINO: the torch module converted directly (no ONNX in between), NNCF for int8, compiled for the CPU.

Conversion traces the module once with dynamic batch and sequence axes, so one graph serves every
batch shape. ``dtype`` is not baked into the graph: it is the CPU plugin's inference precision, chosen when
the graph is compiled (the plugin would pick bf16 by itself on a CPU with native bf16, so float32 is asked
for explicitly).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.core.backends import precision
from inferd.core.backends.base import BackendError, GraphRunner, eager_attention, running_alone
from inferd.core.backends.torch import ExportWrapper
from inferd.core.capabilities import Capabilities

log = logging.getLogger(__name__)

GRAPH = "model.xml"
# The file name optimum-intel gives an exported encoder: a model folder holding one is served as is.
FOLDER_GRAPHS = ("openvino_model.xml", "openvino/openvino_model.xml", "model.xml")
# ``mixed``: bf16 with the graph's index arithmetic and attention products kept in float32 (backends/precision.py).
_PRECISION = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "mixed": "bf16"}
_ACTIVATIONS = ("Gelu", "Swish", "Relu")


def _ov() -> Any:
    try:
        import openvino
    except ImportError as exc:  # the `fast` extra is not installed
        raise BackendError("model.backend openvino needs the openvino package (pip install 'inferd[fast]')") from exc
    return openvino


def export(model: torch.nn.Module, folder: Path, head: str = "hidden") -> Path:
    """Convert the torch module (the encoder, or the encoder with its classification head) to an OpenVINO IR
    in ``folder``; weights stay fp32."""
    ov = _ov()
    wrapper = ExportWrapper(model, head).eval()
    example = dict(zip(wrapper.inputs, wrapper.example(), strict=True))
    shapes = [(name, [-1, -1], ov.Type.i64) for name in wrapper.inputs]
    with warnings.catch_warnings():
        # The tracer warns about Python conditions on shapes in transformers' mask code; the equivalence
        # tests and the accuracy gate check the graph at other shapes, which is what those warnings fear.
        warnings.simplefilter("ignore")
        with torch.inference_mode(False), torch.no_grad(), eager_attention(model):
            graph = ov.convert_model(wrapper, example_input=example, input=shapes)
    return save(graph, folder)


def save(graph: Any, folder: Path) -> Path:
    ov = _ov()
    folder.mkdir(parents=True, exist_ok=True)
    # compress_to_fp16 defaults to True, which would round every weight to fp16: a drift nobody asked for.
    ov.save_model(graph, str(folder / GRAPH), compress_to_fp16=False)
    return folder / GRAPH


def read(path: Path) -> Any:
    return _ov().Core().read_model(str(path))


def compress_weights(graph: Any) -> Any:
    """int8 weights, per output channel (NNCF's INT8_ASYM); activations stay in the inference precision."""
    import nncf

    return nncf.compress_weights(graph, mode=nncf.CompressWeightsMode.INT8_ASYM)


def after_activation(graph: Any) -> list[str]:
    """The matrix products fed by the feed-forward activation (BERT's ``output.dense``), found by shape of
    the graph rather than by name, so any encoder's naming works."""
    return [op.get_friendly_name() for op in graph.get_ops()
            if op.get_type_name() == "MatMul" and op.input_value(0).get_node().get_type_name() in _ACTIVATIONS]


def quantize_static(graph: Any, samples: Iterable[dict[str, Any]], subset_size: int, alpha: float = 0.8,
                    keep_down: bool = True, overflow: str | None = None, preset: str = "MIXED") -> Any:
    """Weights and activations in int8; activation ranges measured on the calibration samples.

    ModelType.TRANSFORMER keeps what int8 hurts most in an encoder (softmax, layer norms) in floating point
    and applies SmoothQuant. Two choices, from all-MiniLM-L6-v2 against the gate's 256 texts (bench/RESULTS.md,
    "Backends"; bench/int8_variants.py measures the variants): the feed-forward down-projections stay in floating
    point (their input is the activation's output, whose outliers a per-tensor int8 scale cannot hold: cosine min
    0.970 with them quantised, 0.995 without; 6 of 36 products), and SmoothQuant's alpha is 0.8 instead of NNCF's
    0.95 (overlap@10 0.941 -> 0.957; 0.5: 0.950, 0.7: 0.957). bf16 float parts depend on the CPU: on a Xeon with
    AMX one long text falls to cosine 0.66, on an AMD Zen 5 they pass (0.995) and run 1.1x faster through the
    server (the same section, Runs A and E); ``dtype: auto``
    tries them and falls back to float32 when the gate refuses them (factory.open_backend). The keyword
    arguments are the knobs bench/int8_variants.py turns (``overflow``: NNCF's OverflowFix, its default when
    None); the server uses the defaults.
    """
    import nncf
    from nncf.quantization.advanced_parameters import (
        AdvancedQuantizationParameters,
        AdvancedSmoothQuantParameters,
        OverflowFix,
    )

    data = list(samples)
    advanced = AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=alpha),
                                              **({"overflow_fix": OverflowFix(overflow)} if overflow else {}))
    return nncf.quantize(graph, nncf.Dataset(data), model_type=nncf.ModelType.TRANSFORMER,
                         preset=getattr(nncf.QuantizationPreset, preset), subset_size=min(subset_size, len(data)),
                         ignored_scope=nncf.IgnoredScope(names=after_activation(graph) if keep_down else [],
                                                         validate=False),
                         advanced_parameters=advanced)


class OpenVINORunner(GraphRunner):
    backend = "openvino"

    def _open(self, graph_path: Path, threads: int, compile_cache: Path | None) -> tuple[str, ...]:
        ov = _ov()
        core = ov.Core()
        if compile_cache is not None:
            # The compiled blob: a warm start skips the graph compilation as well as the export.
            core.set_property({"CACHE_DIR": str(compile_cache)})
        # One stream per instance (core/instances.py), the threads split between them: requests of different
        # instances run at once, each on its own threads.
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": _PRECISION[self.dtype], "PERFORMANCE_HINT": "LATENCY",
                                  "NUM_STREAMS": str(self.streams), "INFERENCE_NUM_THREADS": threads}
        source: Any = str(graph_path)
        self._kept: set[str] = set()
        try:
            if self.dtype == "mixed":
                # Reads the graph itself (not the compile): a damaged or cut short model.bin fails here first.
                source, self._kept = self._mixed(core, graph_path)
            try:
                self._compiled = core.compile_model(source, "CPU", config)
            except RuntimeError:
                if compile_cache is None:
                    raise
                # A blob another process is still writing into the shared compile cache (two prepares, or a
                # fleet's workers, on one cold cache) fails to load: compile from the graph without the cache.
                log.warning("OpenVINO could not compile %s through its compile cache %s; compiling without it",
                            graph_path, compile_cache, exc_info=True)
                core = ov.Core()
                self._compiled = core.compile_model(source, "CPU", config)
            # Several instances: the same graph compiled again as one stream of every thread, for a batch that is
            # its model's only work (core/instances.py Sharing): a lone request on one instance's one thread
            # took 1.3-1.6x as long as on two (bench/RESULTS.md, "Alone on every thread"). The weights are shared
            # between the two (+32 MB for MiniLM bf16, against 162 MB for the first).
            self._wide = None if self.streams == 1 else core.compile_model(
                source, "CPU", {**config, "NUM_STREAMS": "1"})
        except RuntimeError as exc:
            raise BackendError(f"OpenVINO cannot read or compile {graph_path}: {exc}") from exc
        self.capabilities = Capabilities(can_use_all_threads=self._wide is not None, torch_threads=False)
        self._threads = threads
        # One request per calling thread (an instance's worker, or the gate's); results are copied out of it.
        self._requests = threading.local()
        # The plugin takes a precision the CPU cannot run as a hint and runs float32 instead (bf16 without
        # AVX512_BF16 or AMX): what it compiled is read back, so /info and the log say what really runs.
        self._precision = self._compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        if self._precision != _PRECISION[self.dtype]:
            log.warning("OpenVINO runs %s, not the %s asked for: this CPU has no native %s", self._precision,
                        self.dtype, self.dtype)
        return tuple(i.get_any_name() for i in self._compiled.inputs)

    @staticmethod
    def _mixed(core: Any, graph_path: Path) -> tuple[Any, set[str]]:
        """The graph with its index arithmetic and attention products kept in float32 (backends/precision.py), read
        from the marked IR."""
        with tempfile.TemporaryDirectory() as work:
            simplified = precision.simplified(core, graph_path, Path(work))
            xml, kept = precision.marked(simplified, core.read_model(str(simplified)))
            graph = core.read_model(xml, _ov().Tensor(np.fromfile(simplified.with_suffix(".bin"), dtype=np.uint8)))
        if precision.kept(graph) != kept:
            raise BackendError(f"OpenVINO did not take the float32 marks of {graph_path}'s operations "
                               f"(asked for {len(kept)}, read back {len(precision.kept(graph))})")
        return graph, kept

    def _opened(self) -> dict[str, Any]:
        return {"inference_precision": self._precision, "streams": self.streams,
                "threads_alone": self._threads if self.capabilities.can_use_all_threads else None,
                **({"kept_float32": sorted(self._kept)} if self.dtype == "mixed" else {})}

    def runtime_precisions(self) -> dict[str, str]:
        """What the compiled graph runs each operation in, by the operations it was made of (the plugin fuses
        several into one): how a test sees the recipe applied."""
        out = {}
        for op in self._compiled.get_runtime_model().get_ops():
            info = op.get_rt_info()
            for name in info["originalLayersNames"].astype(str).split(","):
                out[name] = info["runtimePrecision"].astype(str)
        return out

    def _run(self, feed: dict[str, Any]) -> Any:
        if self._wide is not None and running_alone():
            request = getattr(self._requests, "alone", None)
            if request is None:
                request = self._requests.alone = self._wide.create_infer_request()
        else:
            request = getattr(self._requests, "request", None)
            if request is None:
                request = self._requests.request = self._compiled.create_infer_request()
        # share_inputs: the request reads the feed's arrays where they are (they live until infer returns), so
        # no input is copied and the bindings' copying path (data_dispatcher.update_inputs: resize the request's
        # own tensor, copy into it) is not taken: that saves a copy, and keeps the request off the one path where
        # two instances' threads have been seen to stall each other (tests/unit/test_instances.py at a load
        # average of 20; 1,300 rounds of two threads starting at once did not reproduce it).
        request.infer({k: np.ascontiguousarray(v) for k, v in feed.items()}, share_inputs=True)
        return request.get_output_tensor(0).data.copy()

    def _release(self) -> None:
        self._requests = threading.local()
        self._compiled = self._wide = None
