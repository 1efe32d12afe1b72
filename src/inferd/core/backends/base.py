"""The backend contract: a runner is the forward pass of one model on one runtime, and nothing else.

A task (the embedding handler today) tokenises, collates, pools and normalises; it hands the runner the
padded ``input_ids`` and ``attention_mask`` (and ``token_type_ids`` where the task has them) and gets the
last hidden state back as a torch tensor, whatever runtime computed it. Which runtime, at which precision
and with which quantisation, is a setting (``model.backend``, ``model.dtype``, ``model.quantize``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from inferd.core.errors import ModelLoadError

log = logging.getLogger(__name__)

BACKENDS = ("torch", "onnx", "openvino")
UNPADDED = ("auto", "true", "false")
QUANTIZE = ("none", "int8-weights", "int8")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The graph's inputs, in this order; a runner feeds zeros for token_type_ids when the task has none.
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# CPU flags that mean bf16 matrix multiplication in hardware (otherwise bf16 is emulated and slow).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# CPU flags that mean int8 dot products in hardware. Without them (AVX2 only) int8 products go through
# vpmaddubsw, whose 16-bit sums saturate: measured on all-MiniLM-L6-v2 on an AMD EPYC (Zen 3), static int8
# ran at 0.7x torch fp32 and fell below its gate (cosine min 0.986, overlap@10 0.923-0.943).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# The flags that decide which kernels a converted graph runs on, and so its accuracy: part of the cache key,
# because a verdict measured with one set says nothing about another.
KERNEL_FLAGS = ("avx2", "avx512f", *INT8_DOT_FLAGS, *NATIVE_BF16_FLAGS, "avx512_fp16")


class BackendError(ModelLoadError):
    """A backend that cannot serve this model with these options; the message names the setting or figure."""


@dataclass(frozen=True)
class GateThresholds:
    """The accuracy gate: the least a converted model must agree with torch fp32 (model.gate.*)."""

    fp32_cosine_min: float = 0.9999
    half_cosine_min: float = 0.9995
    int8_cosine_mean: float = 0.995
    int8_cosine_min: float = 0.99
    int8_overlap_at_10: float = 0.95


@dataclass(frozen=True)
class BackendOptions:
    backend: str = "torch"
    dtype: str = "float32"
    quantize: str = "none"
    # None: $XDG_CACHE_HOME/inferd (or ~/.cache/inferd).
    cache_dir: Path | None = None
    calibration_file: Path | None = None
    gate: GateThresholds = field(default_factory=GateThresholds)
    # Texts the gate compares (and the int8 calibration uses) from the built-in multilingual set.
    gate_texts: int = 256
    calibration_texts: int = 300
    # Intra-op threads for ONNX Runtime / OpenVINO; 0 = torch's count (runtime.torch_threads sets it).
    threads: int = 0
    # The torch backend on real tokens only (varlen.py): auto | true | false.
    unpadded: str = "auto"


class Runner(Protocol):
    backend: str
    dtype: str
    quantize: str
    device: torch.device
    # Whether memory lives in torch's (CUDA) caching allocator: only then may the memory guard empty it.
    uses_torch_allocator: bool
    # Whether padded positions cost compute (a batch costs its size times its longest text): a padding floor
    # is for runners that pad; a batch on one that does not costs its real tokens, whatever their lengths.
    pads: bool
    # What /info shows about how this forward pass runs (cache, export, gate figures).
    info: dict[str, Any]

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor: ...
    def close(self) -> None: ...


def options_for(spec: Any) -> BackendOptions:
    """The backend options a ModelSpec carries."""
    thresholds = dict(spec.gate)
    sizes = {k: int(thresholds.pop(k)) for k in ("texts", "calibration_texts") if k in thresholds}
    # YAML and the environment give true/false as booleans; a spec without the field means auto.
    unpadded = getattr(spec, "unpadded", "auto")
    return BackendOptions(
        backend=spec.backend, dtype=spec.dtype, quantize=spec.quantize,
        cache_dir=Path(spec.cache_dir).expanduser() if spec.cache_dir else None,
        calibration_file=Path(spec.calibration_file).expanduser() if spec.calibration_file else None,
        gate=GateThresholds(**thresholds), gate_texts=sizes.get("texts", 256),
        calibration_texts=sizes.get("calibration_texts", 300),
        unpadded=str(unpadded).lower() if isinstance(unpadded, bool) else str(unpadded))


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there, e.g. macOS)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def native_bf16(flags: set[str]) -> bool:
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def kernel_flags(flags: set[str]) -> list[str]:
    return sorted(f for f in KERNEL_FLAGS if f in flags)


def quantize_warning(quantize: str, flags: set[str]) -> str | None:
    """Why static int8 is a poor choice on this CPU, or None (for the log, /info and a gate refusal)."""
    if quantize != "int8" or any(f in flags for f in INT8_DOT_FLAGS):
        return None
    return ("this CPU has no int8 dot-product instructions (avx512_vnni, avx_vnni or amx_int8): static int8 "
            "runs no faster than float32 here and loses accuracy (16-bit sums saturate); use quantize: none "
            "or int8-weights")


# The reason resolve_dtype gives when it tries bf16 float parts for static int8 (export.open_backend falls back).
INT8_BF16_FIRST = "static int8 with bf16 float parts, float32 if the accuracy gate refuses them"


def resolve_dtype(requested: str, backend: str, device: torch.device,
                  flags: set[str] | None = None, quantize: str = "none") -> tuple[str, str]:
    """The precision to run at, and why (for the log and /info).

    ``auto`` means: float16 on CUDA; bfloat16 on a CPU that multiplies bf16 in hardware (AVX512-BF16 or
    AMX), where it is near-lossless and about twice as fast; float32 anywhere else. Static int8 on OpenVINO
    keeps bf16 float parts only if its gate passes them (the caller falls back to float32, see
    ``INT8_BF16_FIRST``): on an AMD Zen 5 they passed (3.9x torch), on a Xeon with AMX one MiniLM text fell
    to cosine 0.66.
    """
    if requested not in DTYPES:
        raise BackendError(f"model.dtype {requested!r}: choose one of {', '.join(DTYPES)}")
    cuda = device.type == "cuda"
    if requested == "auto":
        if cuda:
            return "float16", "auto: float16 on CUDA"
        have = sorted(f for f in NATIVE_BF16_FLAGS if f in (cpu_flags() if flags is None else flags))
        if quantize == "int8" and have and backend == "openvino":
            return "bfloat16", f"auto: {INT8_BF16_FIRST} (the CPU has native bf16: {', '.join(have)})"
        if quantize == "int8":
            return "float32", "auto: static int8 keeps its floating-point parts in float32"
        if have and backend != "onnx":
            return "bfloat16", f"auto: the CPU has native bf16 ({', '.join(have)})"
        if have:
            return "float32", "auto: ONNX Runtime has no bf16 kernels on the CPU"
        return "float32", "auto: the CPU has no native bf16 (avx512_bf16 or amx_bf16)"
    if requested == "float16" and not cuda and backend != "torch":
        raise BackendError(f"model.dtype float16 is for CUDA; the {backend} backend runs on the CPU "
                           "(use bfloat16 or auto)")
    if requested == "bfloat16" and backend == "onnx":
        raise BackendError("model.dtype bfloat16: ONNX Runtime has no bf16 kernels on the CPU "
                           "(use the openvino backend, or float32)")
    if requested == "bfloat16" and not cuda and not native_bf16(cpu_flags() if flags is None else flags):
        log.warning("model.dtype bfloat16 on a CPU without native bf16: emulated, likely slower than float32")
    return requested, "configured"


def check_options(options: BackendOptions, device: torch.device) -> None:
    """Combinations that cannot work, refused before anything loads."""
    if options.backend not in BACKENDS:
        raise BackendError(f"model.backend {options.backend!r}: choose one of {', '.join(BACKENDS)}")
    if options.unpadded not in UNPADDED:
        raise BackendError(f"model.unpadded {options.unpadded!r}: choose one of {', '.join(UNPADDED)}")
    if options.unpadded == "true" and options.backend != "torch":
        raise BackendError(f"model.unpadded true is the torch backend's; {options.backend} runs every row to the "
                           "batch's longest (set model.unpadded: auto)")
    if options.quantize not in QUANTIZE:
        raise BackendError(f"model.quantize {options.quantize!r}: choose one of {', '.join(QUANTIZE)}")
    if options.backend == "torch" and options.quantize != "none":
        raise BackendError(f"model.quantize {options.quantize} needs model.backend onnx or openvino")
    if options.backend == "onnx" and options.quantize == "int8-weights":
        raise BackendError("model.quantize int8-weights is OpenVINO's (NNCF weight compression); "
                           "with onnx use int8")
    if options.backend != "torch" and device.type != "cpu":
        raise BackendError(f"model.backend {options.backend} runs on the CPU; model.device {device} is for "
                           "the torch backend (set model.device: cpu)")


def gate_kind(dtype: str, quantize: str) -> str:
    """Which thresholds apply: int8, half (bf16/fp16) or fp32."""
    if quantize != "none":
        return "int8"
    return "half" if dtype in ("float16", "bfloat16") else "fp32"


def graph_inputs(ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor | None,
                 names: tuple[str, ...]) -> dict[str, Any]:
    """The numpy inputs a graph with these input names takes (int64, as exported)."""
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    if "token_type_ids" in names:
        feed["token_type_ids"] = (token_type_ids.numpy() if token_type_ids is not None
                                  else torch.zeros_like(ids).numpy())
    return {name: feed[name] for name in names}
