"""The backend contract: a runner is the forward pass of one model on one runtime, and nothing else.

A task tokenises and collates (``tasks.base.collate``, one for every task); it hands the runner the padded
``input_ids`` and ``attention_mask`` (and ``token_type_ids`` where the inputs are pairs) and gets back, as a
torch tensor whatever runtime computed it, what the task's *head* is:

- ``hidden``: the encoder's last hidden state ``[batch, length, hidden]``, which the embedding task pools;
- ``logits``: a sequence-classification head's float32 logits ``[batch, labels]``, which rerank and
  classification turn into scores and probabilities;
- ``splade``: SPLADE's weights over the vocabulary ``[batch, vocab]``, pooled from the masked-LM logits inside the
  pass (the logits themselves, ``[batch, length, vocab]``, would be the largest tensor of the pass to hand over);
- ``tokens``: what the task's own token-level head module gives ``[batch, length, width]`` (bge-m3's hidden state,
  lexical weight and ColBERT vector side by side; a ColBERT projection), which the task masks and splits.

The last two are the task's modules on top of the model (``head_module``), exported inside the same graph.

Every backend serves both heads: torch eager (padded, or unpadded for BERT), ONNX Runtime and OpenVINO (the
head exported with the encoder, through the same exporter). Which runtime, at which precision and with
which quantisation, is a setting (``model.backend``, ``model.dtype``, ``model.quantize``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from inferd.core.capabilities import Capabilities
from inferd.core.errors import ModelLoadError
from inferd.core.spec import ModelSpec
from inferd.settings import BACKENDS, DTYPES, QUANTIZE, UNPADDED, GateSettings

log = logging.getLogger(__name__)

# What a runner returns (see above); a task names its head when it opens a backend.
HEADS = ("hidden", "logits", "splade", "tokens")
# The heads whose module the task supplies (``head_module(model)``) on top of the loaded model.
TASK_HEADS = ("splade", "tokens")
# The graph's inputs, in this order; a runner feeds zeros for token_type_ids when the task has none.
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# CPU flags that mean bf16 matrix multiplication in hardware (otherwise bf16 is emulated and slow).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# CPU flags that mean int8 dot products in hardware. Without them (AVX2 only) int8 products go through
# vpmaddubsw, whose 16-bit sums saturate: on an AMD EPYC (Zen 3) static int8 all-MiniLM-L6-v2 fell below its gate
# and ran slower than torch fp32 (bench/RESULTS.md, "Backends", Run D).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# The flags that decide which kernels a converted graph runs on, and so its accuracy: part of the cache key,
# because a verdict measured with one set says nothing about another.
KERNEL_FLAGS = ("avx2", "avx512f", *INT8_DOT_FLAGS, *NATIVE_BF16_FLAGS, "avx512_fp16")


class BackendError(ModelLoadError):
    """A backend that cannot serve this model with these options; the message names the setting or figure."""


@dataclass(frozen=True)
class BackendOptions:
    # The task the runner serves (its gate and its cache entry) and the head that task reads.
    task: str = "embedding"
    head: str = "hidden"
    backend: str = "torch"
    dtype: str = "float32"
    quantize: str = "none"
    # None: $XDG_CACHE_HOME/inferd (or ~/.cache/inferd).
    cache_dir: Path | None = None
    calibration_file: Path | None = None
    # The gate's thresholds, and how many built-in texts it compares on (and int8 calibration measures).
    gate: GateSettings = field(default_factory=GateSettings)
    # Intra-op threads for ONNX Runtime / OpenVINO; 0 = torch's count (runtime.torch_threads sets it).
    threads: int = 0
    # The model's instances (core/instances.py): requests run at once, ``threads`` split between them.
    streams: int = 1
    # The torch backend on real tokens only (varlen.py): auto | true | false.
    unpadded: str = "auto"


class Runner(Protocol):
    head: str
    backend: str
    dtype: str
    quantize: str
    device: torch.device
    # What the layers above plan around (padding cost, every thread, staging): read there, not copied.
    capabilities: Capabilities
    # What /info shows about how this forward pass runs (cache, export, gate figures).
    info: dict[str, Any]

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor: ...
    # The modules a background pass may stop before (read only where ``capabilities.pauses``; core/background.py).
    def pause_points(self) -> list[torch.nn.Module]: ...
    def close(self) -> None: ...


def options_for(spec: ModelSpec, task: str = "embedding", head: str = "hidden") -> BackendOptions:
    """The backend options a ModelSpec carries, for a task reading ``head``."""
    unpadded = spec.unpadded  # YAML and the environment give true/false as booleans
    # backend auto starts on torch, which needs no export (core/backends/auto.py judges the others meanwhile).
    backend, quantize = ("torch", "none") if spec.backend == "auto" else (spec.backend, spec.quantize)
    return BackendOptions(
        task=task, head=head, backend=backend, dtype=spec.dtype, quantize=quantize,
        cache_dir=Path(spec.cache_dir).expanduser() if spec.cache_dir else None,
        calibration_file=Path(spec.calibration_file).expanduser() if spec.calibration_file else None,
        gate=spec.gate, unpadded=str(unpadded).lower() if isinstance(unpadded, bool) else str(unpadded),
        # Every instance's threads (resolved at start: core/instances.py; 0 = torch's count) in one compiled model.
        threads=spec.threads * max(1, spec.instances), streams=max(1, spec.instances))


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


# The reason resolve_dtype gives when it tries bf16 float parts for static int8 (factory.open_backend falls back).
INT8_BF16_FIRST = "static int8 with bf16 float parts, float32 if the accuracy gate refuses them"


def resolve_dtype(requested: str, backend: str, device: torch.device,
                  flags: set[str] | None = None, quantize: str = "none") -> tuple[str, str]:
    """The precision to run at, and why (for the log and /info).

    ``auto`` means: float16 on CUDA; bfloat16 on a CPU that multiplies bf16 in hardware (AVX512-BF16 or
    AMX), where it is near-lossless and about twice as fast; float32 anywhere else. Static int8 on OpenVINO
    keeps bf16 float parts only if its gate passes them (the caller falls back to float32, see
    ``INT8_BF16_FIRST``): on an AMD Zen 5 they pass, on a Xeon with AMX one MiniLM text falls to cosine 0.66
    (bench/RESULTS.md, "Backends", Runs E and A).
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
    if requested == "mixed" and backend in ("torch", "onnx"):
        raise BackendError("model.dtype mixed (bf16, index arithmetic and attention in float32) is OpenVINO's; "
                           f"the {backend} backend cannot keep chosen operations in float32 (use backend openvino)")
    if requested == "mixed" and not cuda and not native_bf16(cpu_flags() if flags is None else flags):
        why = "mixed configured, but the CPU has no native bf16 (avx512_bf16 or amx_bf16): OpenVINO runs float32"
        log.warning("model.dtype %s", why)
        return "float32", why
    if requested == "bfloat16" and backend == "onnx":
        raise BackendError("model.dtype bfloat16: ONNX Runtime has no bf16 kernels on the CPU "
                           "(use the openvino backend, or float32)")
    if requested == "bfloat16" and not cuda and not native_bf16(cpu_flags() if flags is None else flags):
        if backend == "openvino":
            # Its CPU plugin takes the precision as a hint and compiles float32 here: say so, and judge and cache
            # what runs (a float32 entry, under the float32 gate) rather than a bf16 label on a float32 graph.
            why = "bfloat16 configured, but the CPU has no native bf16 (avx512_bf16 or amx_bf16): OpenVINO runs float32"
            log.warning("model.dtype %s", why)
            return "float32", why
        log.warning("model.dtype bfloat16 on a CPU without native bf16: emulated, likely slower than float32")
    return requested, "configured"


def check_options(options: BackendOptions, device: torch.device) -> None:
    """Combinations that cannot work, refused before anything loads."""
    if options.head not in HEADS:
        raise BackendError(f"head {options.head!r}: a runner returns one of {', '.join(HEADS)}")
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
    return "half" if dtype in ("float16", "bfloat16", "mixed") else "fp32"


def graph_inputs(ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor | None,
                 names: tuple[str, ...]) -> dict[str, Any]:
    """The numpy inputs a graph with these input names takes (int64, as exported)."""
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    if "token_type_ids" in names:
        feed["token_type_ids"] = (token_type_ids.numpy() if token_type_ids is not None
                                  else torch.zeros_like(ids).numpy())
    return {name: feed[name] for name in names}


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[None]:
    """The module's attention as transformers' eager code (an additive mask, a softmax) while it is traced.

    SDPA takes a boolean mask, and a padded row whose every key is masked (ModernBERT's sliding window past a
    short text's end; a causal model's left padding) is a softmax over nothing: torch answers numbers there, the
    converted graphs NaN, and the NaN reaches every row through the next layer's keys. A tiny ModernBERT on
    OpenVINO answered NaN vectors for a 272-token text batched with a 512-token one, and its cross-encoder NaN
    scores. The eager mask adds the dtype's minimum instead: such a row is a uniform average of padding, finite,
    and masked out later like any padding. (MiniLM on OpenVINO: the same outputs, the same speed.)
    """
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    setter = getattr(model, "set_attn_implementation", None)
    if before in (None, "eager") or setter is None:
        yield
        return
    setter("eager")
    try:
        yield
    finally:
        setter(before)


_alone = threading.local()


@contextlib.contextmanager
def all_threads(on: bool = True) -> Iterator[None]:
    """On an instance's worker thread: the runner calls inside may run on every thread of the model, not the
    instance's share (a runner whose capabilities say ``can_use_all_threads``; core/instances.py ``Sharing`` says
    when an instance is alone)."""
    before = getattr(_alone, "on", False)
    _alone.on = on
    try:
        yield
    finally:
        _alone.on = before


def running_alone() -> bool:
    """Whether this thread's runner calls may use every thread of the model (inside ``all_threads``)."""
    return getattr(_alone, "on", False)


class GraphRunner:
    """What the ONNX Runtime and OpenVINO runners share: an exported graph (either head) run on the CPU.

    A subclass opens its runtime's session for ``graph_path`` in ``_open`` (returning the graph's input
    names) and runs one feed in ``_run``; checking the inputs, the info /info shows and the conversion to a
    torch tensor are here, once.
    """

    backend = "graph"
    # Dynamic shapes, but every row runs to the batch's longest; host memory, so nothing is staged. OpenVINO's,
    # compiled for several instances, can use all threads (openvino.py).
    capabilities = Capabilities(pads=True, torch_threads=False)

    def __init__(self, graph_path: Path, head: str, dtype: str, quantize: str, threads: int = 0,
                 info: dict[str, Any] | None = None, compile_cache: Path | None = None, streams: int = 1) -> None:
        """``streams``: the instances that call it at once (core/instances.py), ``threads`` split between them."""
        self.device = torch.device("cpu")
        self.streams = max(1, streams)
        self.head, self.dtype, self.quantize, self.graph_path = head, dtype, quantize, graph_path
        self._names = self._open(graph_path, threads or torch.get_num_threads(), compile_cache)
        if set(self._names) - set(INPUT_NAMES):
            raise BackendError(f"{graph_path}: unexpected graph inputs {self._names}")
        self.info: dict[str, Any] = {"backend": self.backend, "head": head, "dtype": dtype, "quantize": quantize,
                                     "graph": str(graph_path), **self._opened(), **(info or {})}
        self._open_now = True

    def _opened(self) -> dict[str, Any]:
        """What the runtime says of the session it opened, for /info (what it really runs, where it differs)."""
        return {}

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._names

    def _open(self, graph_path: Path, threads: int, compile_cache: Path | None) -> tuple[str, ...]:
        raise NotImplementedError

    def _run(self, feed: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def pause_points(self) -> list[torch.nn.Module]:
        return []  # a compiled graph runs whole once called

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not self._open_now:
            raise RuntimeError(f"the {self.backend} runner was closed")
        return torch.from_numpy(self._run(graph_inputs(ids, mask, token_type_ids, self._names)))

    def close(self) -> None:
        self._open_now = False
        self._release()
