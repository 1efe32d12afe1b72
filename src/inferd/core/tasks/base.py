"""The task contract: what every handler (embedding, rerank, classification, a user's own) declares.

A handler is loaded once per model slot. ``preprocess`` runs on the CPU (tokenisation) and turns the
request's inputs (texts, or (query, document) pairs, as ``inputs`` says) into one ``Encoded`` item per
input; ``infer`` is the only code that touches the device; ``postprocess`` turns the batch output into one
opaque result per item, which only the task's routes know how to shape. The engine, queue, scheduler and
slots never look inside an item or a result: they move token costs and hand results back in order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from inferd.core.backends.base import Runner, options_for
from inferd.core.backends.factory import open_backend
from inferd.core.errors import ModelLoadError
from inferd.core.families import family_of
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec

log = logging.getLogger(__name__)

# Any one of these lets a fast tokenizer be built; a folder with none has no tokenizer at all.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
# The tasks served by the built-in handlers; a plug-in (``module:Class``) names its own.
BUILTIN_TASKS = ("embedding", "rerank", "classification")
InputKind = Literal["texts", "pairs"]


class Handler(Protocol):
    """The contract. ``task`` and ``inputs`` may be left out by a plug-in: it then serves embeddings of texts.

    ``describe()`` (optional) returns what /info and the reload rules need to know of the loaded model
    (an embedding's size, a classifier's labels); ``incompatibility(serving, allow_change)`` (optional)
    returns why this model may not replace or sit beside the serving one (whose ``describe()`` it gets),
    or None. Without it any model of the same task is accepted.
    """

    name: str
    version: str
    max_seq_length: int
    device: torch.device
    dtype: str

    def load(self, spec: ModelSpec, device: torch.device) -> None: ...
    def preprocess(self, inputs: list[Any]) -> list[Encoded]: ...
    def infer(self, batch: list[Encoded]) -> Any: ...
    def postprocess(self, outputs: Any) -> list[Any]: ...
    def close(self) -> None: ...


def task_of(handler: Any) -> str:
    return str(getattr(handler, "task", "embedding"))


def inputs_of(handler: Any) -> InputKind:
    return "pairs" if getattr(handler, "inputs", "texts") == "pairs" else "texts"


def dimension_refusal(dimension: int | None, serving: Mapping[str, Any], allow_change: bool) -> str | None:
    """Vectors of another size cannot be compared with those clients already stored."""
    old = serving.get("dimension")
    if old is None or old == dimension or allow_change:
        return None
    return (f"embedding dimension is {dimension}, the serving model's is {old}; "
            "set model.allow_dimension_change: true to allow it")


def describe(handler: Any) -> dict[str, Any]:
    """What the handler says of its model; a plug-in written to the first contract (no ``describe``) is an
    embedding handler whose ``dimension`` attribute is its description."""
    fn = getattr(handler, "describe", None)
    if callable(fn):
        return dict(fn())
    dimension = getattr(handler, "dimension", None) if task_of(handler) == "embedding" else None
    return {} if dimension is None else {"dimension": int(dimension)}


def incompatibility(handler: Any, serving: Mapping[str, Any], allow_change: bool) -> str | None:
    """Why this handler's model may not replace the serving one; a plug-in without the method is held to
    the dimension rule when it is an embedding handler."""
    fn = getattr(handler, "incompatibility", None)
    if callable(fn):
        return fn(serving, allow_change)
    if task_of(handler) == "embedding":
        return dimension_refusal(describe(handler).get("dimension"), serving, allow_change)
    return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def check_weights(path: Path, allow_pickle: bool) -> bool:
    """Return whether safetensors weights are there; refuse pickle weights unless allowed."""
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    if any(path.glob("*.safetensors")):
        return True
    if any(path.glob("pytorch_model*.bin")):
        if allow_pickle:
            return False
        raise ModelLoadError(f"{path} holds only pickle weights (pytorch_model.bin); "
                             "set model.allow_pickle: true to load them")
    raise ModelLoadError(f"{path} holds no weights (model.safetensors)")


def check_tokenizer_files(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer that maps every word to [UNK], silently.
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.json or a vocabulary file)")


def load_tokenizer(path: Path) -> tuple[Any, Any]:
    """The folder's config and fast tokenizer (a slow one is refused: the Rust tokenizer does the work), for a
    model of a supported family (core/families.py)."""
    from transformers import AutoConfig, AutoTokenizer

    family_of(path)
    check_tokenizer_files(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {path}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{path}: a fast (tokenizer.json) tokenizer is required")
    return config, tokenizer


def length_limit(config: Any, tokenizer: Any, wanted: int | None) -> int:
    """Tokens per input: the setting or the model's own limit, never more than its position table."""
    limit = min(int(getattr(config, "max_position_embeddings", 512)),
                int(tokenizer.model_max_length) if tokenizer.model_max_length < 1e6 else 512)
    return min(wanted or limit, limit)


def collate(batch: list[Encoded], pad_id: int, segments: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The padded batch every runner takes: ``input_ids``, ``attention_mask`` and (``segments``: for a model
    that reads them) ``token_type_ids``. Padding is masked, so a row never sees another."""
    longest = max(e.tokens for e in batch)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), longest), dtype=np.int64)
    types = np.zeros((len(batch), longest), dtype=np.int64) if segments else None
    for row, enc in enumerate(batch):
        ids[row, : enc.tokens] = enc.ids
        mask[row, : enc.tokens] = 1
        if types is not None and enc.type_ids is not None:
            types[row, : enc.tokens] = enc.type_ids
    return torch.from_numpy(ids), torch.from_numpy(mask), None if types is None else torch.from_numpy(types)


class ModelTask:
    """What the built-in tasks share: a tokenizer's padding id, a runner for the task's head (``hidden`` or
    ``logits``, see backends/base.py) on the configured backend, one collate, and closing the runner.

    A subclass sets ``task``, ``head``, ``pad_id`` and its encoder before ``open_runner``: exporting a graph
    and its accuracy gate run the task's own tokenising and outputs (``run``).
    """

    task: str
    head: str
    pad_id: int = 0
    segments: bool = False
    runner: Runner

    def open_runner(self, spec: ModelSpec, device: torch.device, safetensors: bool) -> None:
        if spec.backend != "torch" and spec.device == "auto":
            device = torch.device("cpu")  # ONNX Runtime and OpenVINO run on the CPU here, GPU or not
        self.runner = open_backend(spec.path, options_for(spec, self.task, self.head), device, self, safetensors)
        self.device = self.runner.device
        self.dtype = self.runner.dtype
        self.backend, self.quantize, self.backend_info = self.runner.backend, self.runner.quantize, self.runner.info

    def collate(self, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return collate(batch, self.pad_id, self.segments)

    def run(self, runner: Runner, batch: list[Encoded]) -> np.ndarray:
        raise NotImplementedError

    def infer(self, batch: list[Encoded]) -> np.ndarray:
        return self.run(self.runner, batch)

    def close(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
