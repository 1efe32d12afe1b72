"""The embedding task: texts in, one pooled vector per text out (served on /v1/embeddings and /predict)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.core.errors import ModelLoadError
from inferd.core.preprocess import Encoded, TextEncoder
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import ModelTask, check_weights, dimension_refusal, length_limit, load_tokenizer


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


def allows_change(model: Any) -> bool:
    """The operator's consent to a model whose results are not comparable with the serving one's (the
    setting is named for the embedding task, where it first mattered; the other tasks' rules ignore it)."""
    return bool(model.allow_dimension_change)


class EmbeddingHandler(ModelTask):
    """Sentence embeddings from a Hugging Face encoder, pooled as the model's own configuration says."""

    task = "embedding"
    inputs = "texts"
    head = "hidden"

    def load(self, spec: ModelSpec, device: torch.device) -> None:
        safetensors = check_weights(spec.path, spec.allow_pickle)
        st_pooling, st_normalize, st_max = read_st_config(spec.path)
        config, tokenizer = load_tokenizer(spec.path)
        self.name = spec.name
        self.version = spec.version
        self.dimension = int(config.hidden_size)
        limit = length_limit(config, tokenizer, None)
        self.max_seq_length = min(spec.max_seq_length or st_max or limit, limit)
        self.pooling = spec.pooling or st_pooling or "mean"
        self.normalize = spec.normalize if spec.normalize is not None else st_normalize
        self.pad_id = tokenizer.pad_token_id or 0
        self.encoder = TextEncoder(tokenizer.backend_tokenizer, self.max_seq_length, spec.truncate)
        self._pool = POOLERS[self.pooling]
        self.open_runner(spec, device, safetensors)  # last: see ModelTask

    def describe(self) -> dict[str, Any]:
        return {"dimension": self.dimension, "pooling": self.pooling, "normalize": self.normalize}

    def incompatibility(self, serving: Mapping[str, Any], allow_change: bool) -> str | None:
        return dimension_refusal(self.dimension, serving, allow_change)

    def preprocess(self, texts: list[str]) -> list[Encoded]:
        return self.encoder.encode(texts)

    def run(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        """Pooled vectors for a batch, the forward pass on ``runner`` (the accuracy gate passes torch's)."""
        ids, mask, _ = self.collate(batch)
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
