"""The task contract and the embedding task.

A handler is loaded once per model slot. ``preprocess`` runs on the CPU (tokenisation), ``infer`` is the
only code that touches the device, ``postprocess`` turns the batch output into one result per item.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from inferd.core.preprocess import Encoded, TextEncoder

log = logging.getLogger(__name__)

# Any one of these lets a fast tokenizer be built; a folder with none has no tokenizer at all.
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                    "sentencepiece.bpe.model")


class ModelLoadError(Exception):
    """A model folder that cannot be served; the message names the cause."""


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    name: str
    version: str
    task: str = "embedding"
    device: str = "auto"
    dtype: str = "float32"
    pooling: str | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None
    truncate: bool = True
    allow_pickle: bool = False
    warmup: bool = True
    # The forward pass's runtime (core/backends/): torch | onnx | openvino, quantisation, export cache.
    backend: str = "torch"
    quantize: str = "none"
    cache_dir: str | None = None
    calibration_file: str | None = None
    gate: tuple[tuple[str, float], ...] = ()  # model.gate.* thresholds that differ from the defaults


class Handler(Protocol):
    name: str
    version: str
    dimension: int
    max_seq_length: int
    device: torch.device
    dtype: str

    def load(self, spec: ModelSpec, device: torch.device) -> None: ...
    def preprocess(self, texts: list[str]) -> list[Encoded]: ...
    def infer(self, batch: list[Encoded]) -> Any: ...
    def postprocess(self, outputs: Any) -> list[Any]: ...
    def close(self) -> None: ...


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average of the token vectors that the attention mask keeps (padding excluded)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


def cls_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


POOLERS = {"mean": mean_pool, "cls": cls_pool}


def read_st_config(path: Path) -> tuple[str | None, bool, int | None]:
    """What the model's sentence-transformers files say: pooling mode, normalisation, max length."""
    pooling, normalize, max_len = None, False, None
    modules = path / "modules.json"
    if modules.is_file():
        for module in json.loads(modules.read_text()):
            kind = module.get("type", "")
            if kind.endswith("Pooling"):
                cfg = json.loads((path / module["path"] / "config.json").read_text())
                if cfg.get("pooling_mode_cls_token"):
                    pooling = "cls"
                elif cfg.get("pooling_mode_mean_tokens"):
                    pooling = "mean"
                else:
                    raise ModelLoadError(f"{path}: unsupported pooling mode in {module['path']}/config.json")
            elif kind.endswith("Normalize"):
                normalize = True
    st = path / "sentence_bert_config.json"
    if st.is_file():
        max_len = json.loads(st.read_text()).get("max_seq_length")
    return pooling, normalize, max_len


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


class EmbeddingHandler:
    """Sentence embeddings from a Hugging Face encoder, pooled as the model's own configuration says."""

    def load(self, spec: ModelSpec, device: torch.device) -> None:
        from transformers import AutoConfig, AutoTokenizer

        safetensors = check_weights(spec.path, spec.allow_pickle)
        if not any((spec.path / f).is_file() for f in _TOKENIZER_FILES):
            # transformers would build an empty tokenizer that maps every word to [UNK], silently.
            raise ModelLoadError(f"{spec.path} has no tokenizer (tokenizer.json or a vocabulary file)")
        st_pooling, st_normalize, st_max = read_st_config(spec.path)
        try:
            config = AutoConfig.from_pretrained(spec.path, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load {spec.path}: {exc}") from exc
        if not getattr(tokenizer, "is_fast", False):
            raise ModelLoadError(f"{spec.path}: a fast (tokenizer.json) tokenizer is required")
        self.name = spec.name
        self.version = spec.version
        self.dimension = int(config.hidden_size)
        limit = min(int(getattr(config, "max_position_embeddings", 512)),
                    int(tokenizer.model_max_length) if tokenizer.model_max_length < 1e6 else 512)
        self.max_seq_length = min(spec.max_seq_length or st_max or limit, limit)
        self.pooling = spec.pooling or st_pooling or "mean"
        self.normalize = spec.normalize if spec.normalize is not None else st_normalize
        self.pad_id = tokenizer.pad_token_id or 0
        self.encoder = TextEncoder(tokenizer.backend_tokenizer, self.max_seq_length, spec.truncate)
        self._pool = POOLERS[self.pooling]
        # Last: exporting a graph and its accuracy gate run this task's own tokenising and pooling.
        from inferd.core.backends import open_backend, options_for

        if spec.backend != "torch" and spec.device == "auto":
            device = torch.device("cpu")  # ONNX Runtime and OpenVINO run on the CPU here, GPU or not
        self.runner = open_backend(spec.path, options_for(spec), device, self, safetensors)
        self.device = self.runner.device
        self.dtype = self.runner.dtype
        self.backend, self.quantize, self.backend_info = self.runner.backend, self.runner.quantize, self.runner.info

    def preprocess(self, texts: list[str]) -> list[Encoded]:
        return self.encoder.encode(texts)

    def collate(self, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(e.tokens for e in batch)
        ids = np.full((len(batch), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), longest), dtype=np.int64)
        for row, enc in enumerate(batch):
            ids[row, : enc.tokens] = enc.ids
            mask[row, : enc.tokens] = 1
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def infer(self, batch: list[Encoded]) -> np.ndarray:
        return self.run(self.runner, batch)

    def run(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        """Pooled vectors for a batch, the forward pass on ``runner`` (the accuracy gate passes torch's)."""
        ids, mask = self.collate(batch)
        with torch.inference_mode():
            hidden = runner(ids, mask)
            pooled = self._pool(hidden, mask.to(hidden.device)).float()
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return pooled.cpu().numpy()

    def postprocess(self, outputs: np.ndarray) -> list[np.ndarray]:
        return list(outputs)

    def warmup(self) -> None:
        sample = self.preprocess(["warm up", "a somewhat longer sentence to warm up the padded path"])
        self.infer(sample)
        self.infer(sample[:1])

    def close(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
