"""The rerank task: (query, document) pairs in, one relevance score per pair out (/v1/rerank, /rerank).

A cross-encoder is a sequence classifier with one label reading query and document together. Its score
is the logit passed through the activation its sentence-transformers configuration names (sigmoid when it
names none), so scores equal ``sentence_transformers.CrossEncoder(path).predict(pairs)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from inferd.core.description import ModelDescription, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.preprocess import Encoded, PairEncoder
from inferd.core.spec import ModelSpec
from inferd.core.tasks.sequence import SequenceClassifier
from inferd.core.text_options import PLAIN_INPUTS, InputOptions

# The activations sentence-transformers writes (by class path); anything else is refused, not guessed.
ACTIVATIONS = {"Sigmoid": torch.sigmoid, "Identity": lambda x: x, "Tanh": torch.tanh}


def activation_name(config: Any) -> str:
    """The CrossEncoder activation a model's config.json names (v4+ and older layouts), else Sigmoid."""
    st = getattr(config, "sentence_transformers", None)
    path = st.get("activation_fn") if isinstance(st, dict) else None
    path = path or getattr(config, "sbert_ce_default_activation_function", None)
    return str(path).rsplit(".", 1)[-1] if path else "Sigmoid"


class RerankHandler(SequenceClassifier):
    task = "rerank"
    inputs = "pairs"

    def configure(self, spec: ModelSpec) -> None:
        if spec.settings.rerank_instruction is not None:
            raise ModelLoadError(f"{spec.path}: model.rerank_instruction is for an LLM reranker (a causal LM); a "
                                 "cross-encoder takes no instruction")
        if self.num_labels != 1:
            raise ModelLoadError(f"{spec.path}: a reranker (cross-encoder) has one label, this model has "
                                 f"{self.num_labels}; serve it as model.task: classification")
        self.activation = activation_name(self.config)
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(f"{spec.path}: unsupported cross-encoder activation {self.activation!r} "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        self._activate = ACTIVATIONS[self.activation]
        self.encoder = PairEncoder(self.tokenizer, self.max_seq_length, self.truncate)

    def facts(self) -> TaskFacts:
        return TaskFacts(other={"activation": self.activation})

    def incompatibility(self, serving: ModelDescription, allow_change: bool) -> str | None:
        return None  # scores are ranked within one request: any cross-encoder can replace another

    def preprocess(self, pairs: list[tuple[str, str]], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        return self.encoder.encode(pairs, options)

    def document_room(self, query: str) -> int | None:
        return self.encoder.room(query)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        raw = logits[:, 0]
        return torch.stack([self._activate(raw), raw], dim=1)

    def postprocess(self, outputs: np.ndarray) -> list[np.ndarray]:
        """Per pair: [score, raw logit] (TEI's ``raw_scores`` asks for the second)."""
        return list(outputs)

    def warmup(self) -> None:
        self.infer(self.preprocess([("warm up", "a document"), ("warm up", "a longer document to pad")]))
