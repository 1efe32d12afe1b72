"""PyTorch eager: the reference forward pass, and the module every other backend is exported from."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from inferd.core import checkpoint, load_guard
from inferd.core.backends import masks
from inferd.core.backends.base import BackendError
from inferd.core.capabilities import Capabilities

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The exported graph's output, by head.
OUTPUT_NAMES = {"hidden": "last_hidden_state", "logits": "logits", "splade": "weights", "tokens": "token_outputs"}


def load_model(path: Path, safetensors: bool, head: str = "hidden", dtype: str = "float32") -> torch.nn.Module:
    """The encoder (head ``hidden``, ``tokens``), the encoder with its sequence-classification head (``logits``) or
    its masked-LM head (``splade``), its weights checked against the architecture config.json names: before it
    is built, against the checkpoint's headers (core/checkpoint.py), and after, against what transformers read."""
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    auto = {"logits": AutoModelForSequenceClassification, "splade": AutoModelForMaskedLM}.get(head, AutoModel)
    # The pooler is unused by embedding pooling and often absent (a classification head reads it, so there it
    # must be there).
    optional = () if head == "logits" else ("pooler.",)
    load_guard.stage("reading the checkpoint")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise BackendError(f"cannot load {path}: {exc}") from exc
    held = checkpoint.read_held(path, safetensors)
    if held is not None:
        checkpoint.check_config(path, config, held)
        implied = checkpoint.check_size(path, skeleton(auto, config), held, optional, _DTYPES[dtype].itemsize)
        checkpoint.check_room(path, implied * _DTYPES[dtype].itemsize, checkpoint.memory_available())
    load_guard.stage("building the model")
    try:
        model, loading = auto.from_pretrained(
            path, local_files_only=True, use_safetensors=safetensors, dtype=_DTYPES[dtype],
            output_loading_info=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise BackendError(f"cannot load {path}: {exc}") from exc
    load_guard.stage("built")
    # Weights that do not fit the architecture config.json names are left random, or dropped, with only a
    # warning: a model that would serve noise, or other vectors than its own.
    missing = sorted(k for k in loading["missing_keys"] if not k.startswith(optional))
    unused = checkpoint.unexpected_layers(loading["unexpected_keys"])
    if missing or loading["mismatched_keys"] or unused:
        raise BackendError(
            f"{path}: the weights do not fit the {model.config.model_type!r} architecture config.json names "
            f"({len(missing)} missing, e.g. {missing[:2]}; {len(loading['mismatched_keys'])} of the wrong "
            f"shape; {len(unused)} of layers it does not name, e.g. {unused[:2]}): wrong architecture or a "
            "damaged checkpoint")
    return model.eval()


def skeleton(auto: Any, config: Any) -> torch.nn.Module:
    """The model ``config`` describes, built on torch's meta device: every parameter's shape, no memory."""
    try:
        with torch.device("meta"):
            return auto.from_config(config)
    except Exception as exc:  # a config transformers cannot build raises nearly anything (a head count, a size)
        raise BackendError(f"config.json describes no model transformers can build: {type(exc).__name__}: "
                           f"{exc}") from None


def output_of(out: Any, head: str) -> torch.Tensor:
    """What a transformers model's output holds for ``head``: the last hidden state, or float32 logits; a task's
    head module (``splade``, ``tokens``) answers its tensor itself."""
    if isinstance(out, torch.Tensor):
        return out
    return out.logits.float() if head == "logits" else out.last_hidden_state


def accepts_token_type_ids(model: torch.nn.Module) -> bool:
    import inspect

    own = getattr(model, "takes_token_type_ids", None)  # a task's head module says whether the model under it does
    if own is not None:
        return bool(own)
    return "token_type_ids" in inspect.signature(model.forward).parameters


def no_cache(model: torch.nn.Module) -> dict[str, bool]:
    """``use_cache=False`` for a decoder: one forward pass over whole texts needs no key/value cache, and building
    one costs memory on torch and puts cache concatenations the OpenVINO converter cannot take into an export."""
    import inspect

    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


class TorchRunner:
    """Eager forward pass. bf16 on a CPU runs under autocast (fp32 weights, bf16 matrix products): the
    weights keep full precision and the gain is the same; on CUDA the weights themselves are cast."""

    backend = "torch"
    quantize = "none"
    # Eager transformers computes every padded position. It does not widen: it cannot run a batch on more threads
    # than its instance's, as torch's count belongs to the calling thread, and one changed per batch left OpenMP
    # teams spinning on each other's cores (bench/RESULTS.md, "Alone on every thread"). On a CUDA device its
    # inputs are staged (``__init__``).
    capabilities = Capabilities(pads=True, can_use_all_threads=False)

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: str = "float32",
                 info: dict[str, Any] | None = None, head: str = "hidden") -> None:
        self.head = head
        self.device = device
        self.dtype = dtype
        self.capabilities = replace(type(self).capabilities, stages=device.type == "cuda",
                                    pauses=device.type == "cpu")
        self._autocast = device.type == "cpu" and dtype == "bfloat16"
        weights = torch.float32 if self._autocast else _DTYPES[dtype]
        self.model: torch.nn.Module | None = model.to(device=device, dtype=weights).eval()
        self._token_types = accepts_token_type_ids(model)
        self._extra = no_cache(model)
        self.info: dict[str, Any] = {"backend": "torch", "head": head, "dtype": dtype, "quantize": "none",
                                     **(info or {})}
        if self._autocast:
            self.info["autocast"] = "bfloat16"

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("the torch runner was closed")
        segments = token_type_ids.to(self.device) if token_type_ids is not None and self._token_types else None
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self._autocast else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            return self._forward(ids.to(self.device), mask.to(self.device), segments)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        """The head's output for the padded batch (inputs already on the device, autocast already set)."""
        assert self.model is not None
        kwargs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
        if segments is not None:
            kwargs["token_type_ids"] = segments
        return output_of(self.model(**kwargs, **self._extra), self.head)

    def pause_points(self) -> list[torch.nn.Module]:
        """Where a background pass may stop while live batches run (core/background.py): before each linear
        layer, which the padded pass and the unpadded one (varlen.py) both call as modules. A BERT layer holds six,
        so a pass gives the cores back within about a fortieth of its time on a six-layer model."""
        return [] if self.model is None else [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]

    def close(self) -> None:
        self.model = None


class ExportWrapper(torch.nn.Module):
    """What the exporters trace: positional int64 inputs in, one tensor out (the head's: the last hidden
    state, or the classification head's float32 logits).

    The pooler output and the attentions of an encoder are left out of the graph; the task pools on its own.
    """

    def __init__(self, model: torch.nn.Module, head: str = "hidden") -> None:
        super().__init__()
        self.model = model
        self.head = head
        self.output = OUTPUT_NAMES.get(head, "last_hidden_state")
        self.inputs = ("input_ids", "attention_mask", "token_type_ids") if accepts_token_type_ids(model) \
            else ("input_ids", "attention_mask")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if masks.bidirectional(self.model):
            # Its own mask code cannot be traced (backends/masks.py): the masks, built here, go in ready-made.
            kwargs["attention_mask"] = masks.prepared(self.model, attention_mask, torch.float32)
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        return output_of(self.model(**kwargs, **no_cache(self.model)), self.head)

    def example(self, batch: int = 2, length: int = 8) -> tuple[torch.Tensor, ...]:
        """Trace inputs whose mask holds padding: a mask of all ones could let a library skip masking."""
        ids = torch.full((batch, length), 5, dtype=torch.long)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1:, length // 2:] = 0
        out = (ids, mask)
        return (*out, torch.zeros_like(ids)) if len(self.inputs) == 3 else out
