"""ONNX Runtime: the torch module exported with dynamic batch and sequence axes, run on the CPU provider.

The export is torch's TorchScript exporter with ``dynamic_axes`` on every input and on the output, traced
with a padded example: a graph traced without dynamic axes (or from an all-ones mask) bakes the example's
shape or its masking in, and gives wrong outputs for other batches. The equivalence tests and the accuracy
gate check the graph at other shapes than the example's. (torch's newer dynamo exporter needs onnxscript,
which this project does not install.)

int8 is ONNX Runtime's static quantisation (QDQ, per-channel weights, activation ranges from calibration):
dynamic quantisation computes activation scales over each batch, padding included, so a text's output
would change with the texts it is batched with.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from inferd.core.backends.base import BackendError, GraphRunner, eager_attention
from inferd.core.backends.torch import ExportWrapper

log = logging.getLogger(__name__)

GRAPH = "model.onnx"
# Where sentence-transformers / optimum put an exported graph: a model folder holding one is served as is.
FOLDER_GRAPHS = ("onnx/model.onnx", "model.onnx")
OPSET = 17
_ACTIVATIONS = ("Erf", "Gelu", "FastGelu", "Relu", "Sigmoid")


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:  # the `fast` extra is not installed
        raise BackendError("model.backend onnx needs onnxruntime and onnx (pip install 'inferd[fast]')") from exc
    return onnxruntime


def export(model: torch.nn.Module, folder: Path, head: str = "hidden") -> Path:
    """Export to ``folder``/model.onnx with every batch and sequence axis dynamic (the logits of a
    classification head have a batch axis only)."""
    _ort()
    wrapper = ExportWrapper(model, head).eval()
    axes = {name: {0: "batch", 1: "sequence"} for name in wrapper.inputs}
    axes[wrapper.output] = {0: "batch", 1: "sequence"} if head in ("hidden", "tokens") else {0: "batch"}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / GRAPH
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of dynamo (which needs onnxscript) and the tracer
        # warns about shape conditions; the graph is checked at other shapes, which is what they warn about.
        warnings.simplefilter("ignore")
        with torch.inference_mode(False), torch.no_grad(), eager_attention(model):
            torch.onnx.export(wrapper, wrapper.example(), str(path), input_names=list(wrapper.inputs),
                              output_names=[wrapper.output], dynamic_axes=axes, opset_version=OPSET,
                              do_constant_folding=True, dynamo=False)
    return path


class _Reader:
    """ONNX Runtime's CalibrationDataReader over prepared input dicts."""

    def __init__(self, samples: Iterable[dict[str, Any]]) -> None:
        self._it: Iterator[dict[str, Any]] = iter(list(samples))

    def get_next(self) -> dict[str, Any] | None:
        return next(self._it, None)


def weight_products(path: Path) -> list[str]:
    """MatMul nodes with a weight (an initializer) as input, minus those fed by the feed-forward
    activation: the products of two activations (attention scores) and the activation's outliers are what
    per-tensor int8 ranges hold worst."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}

    def after_activation(node: Any, depth: int = 6) -> bool:
        # GELU is exported as Div/Erf/Add/Mul/Mul: look a few producers up for the Erf (or a fused op).
        frontier = [producer.get(node.input[0])]
        for _ in range(depth):
            if any(n is not None and n.op_type in _ACTIVATIONS for n in frontier):
                return True
            frontier = [producer.get(i) for n in frontier if n is not None for i in n.input]
        return False

    return [n.name for n in graph.node
            if n.op_type == "MatMul" and any(i in weights for i in n.input) and not after_activation(n)]


def quantize_static(source: Path, folder: Path, samples: Iterable[dict[str, Any]]) -> Path:
    """int8 weights (per channel) and activations (ranges from the calibration samples), QDQ format,
    unsigned activations and signed weights (ONNX Runtime's fast path on x86).

    On all-MiniLM-L6-v2 this stays below the int8 gate, even with the feed-forward down-projections left in
    float: the gate refuses it (bench/RESULTS.md, "Backends", Run B: the onnx int8 row).
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(_Reader, CalibrationDataReader):
        pass

    folder.mkdir(parents=True, exist_ok=True)
    prepared = folder / "prepared.onnx"
    out = folder / GRAPH
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Shape inference and graph cleanup first, as ONNX Runtime's quantisation guide asks.
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(out), Reader(samples), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        nodes_to_quantize=weight_products(prepared),
                        extra_options={"ActivationSymmetric": False, "WeightSymmetric": True})
    prepared.unlink(missing_ok=True)
    return out


class OnnxRunner(GraphRunner):
    backend = "onnx"

    def _open(self, graph_path: Path, threads: int, compile_cache: Path | None) -> tuple[str, ...]:
        ort = _ort()
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Each instance's share: a run uses the calling thread and the session's pool, which concurrent runs share
        # (at one thread per instance there is no pool: every instance computes on its own thread alone).
        options.intra_op_num_threads = max(1, threads // self.streams)
        options.inter_op_num_threads = 1
        # Spinning threads would steal the event loop's core.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types for a broken graph
            raise BackendError(f"ONNX Runtime cannot load {graph_path}: {exc}") from exc
        return tuple(i.name for i in self._session.get_inputs())

    def _run(self, feed: dict[str, Any]) -> Any:
        return self._session.run(None, feed)[0]

    def _release(self) -> None:
        self._session = None
