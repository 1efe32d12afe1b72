"""The classification task: texts in, one probability per label out (/v1/classify, /predict).

Labels come from the model's ``id2label``; probabilities are a softmax over the labels, or one sigmoid
per label when the config says ``problem_type: multi_label_classification`` (as transformers' pipeline).
"""

from __future__ import annotations

import numpy as np
import torch

from inferd.core.description import ModelDescription, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.preprocess import Encoded, TextEncoder
from inferd.core.spec import ModelSpec
from inferd.core.tasks.sequence import SequenceClassifier
from inferd.core.text_options import PLAIN_INPUTS, InputOptions


class ClassificationHandler(SequenceClassifier):
    task = "classification"
    inputs = "texts"

    def configure(self, spec: ModelSpec) -> None:
        if self.num_labels < 2:
            raise ModelLoadError(f"{spec.path}: a classifier needs two labels or more, this model has "
                                 f"{self.num_labels}; a one-label model is a cross-encoder (model.task: rerank)")
        id2label = self.config.id2label
        self.labels = [str(id2label[i]) for i in range(self.num_labels)]
        self.multi_label = getattr(self.config, "problem_type", None) == "multi_label_classification"
        self.encoder = TextEncoder(self.tokenizer, self.max_seq_length, self.truncate)

    def facts(self) -> TaskFacts:
        return TaskFacts(labels=tuple(self.labels), multi_label=self.multi_label)

    def incompatibility(self, serving: ModelDescription, allow_change: bool) -> str | None:
        """Clients act on label names: a model that answers with other labels is another service."""
        old = serving.labels
        if old is None or list(old) == self.labels:
            return None
        return f"labels {self.labels}, the serving model's are {list(old)}; a classifier keeps its label set"

    def preprocess(self, texts: list[str], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        return self.encoder.encode(texts, options)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)

    def postprocess(self, outputs: np.ndarray) -> list[np.ndarray]:
        return list(outputs)

    def warmup(self) -> None:
        self.infer(self.preprocess(["warm up", "a somewhat longer sentence to warm up the padded path"]))
