"""What the rerank and classification tasks share: a ``*ForSequenceClassification`` model whose runner
returns one row of logits per input (a text, or a query/document pair with segment ids), on any backend."""

from __future__ import annotations

import numpy as np
import torch

from inferd.core.backends.base import Runner
from inferd.core.description import Loaded
from inferd.core.errors import ModelLoadError
from inferd.core.families import family_of
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import ModelTask, check_weights, length_limit, load_tokenizer


class SequenceClassifier(ModelTask):
    """Loads the folder's tokenizer and config and a runner for its classification head (``logits``);
    subclasses say what a row of logits means (``configure`` checks the config and builds the encoder,
    ``scores`` turns logits into the task's outputs)."""

    head = "logits"

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        safetensors = check_weights(spec.path, spec.allow_pickle)
        config, tokenizer = load_tokenizer(spec.path)
        self.config = config
        self.max_seq_length = length_limit(config, tokenizer, spec.max_seq_length)
        self.pad_id = tokenizer.pad_token_id or 0
        if family_of(spec.path).kind == "decoder":
            # A decoder's head reads the last token that is not padding, found by comparing the ids with the
            # config's padding id: the batch must be padded with that id, and without one no batch can be.
            if config.pad_token_id is None:
                raise ModelLoadError(f"{spec.path}: a decoder sequence classifier needs pad_token_id in config.json "
                                     "(its head reads the last token that is not padding)")
            self.pad_id = int(config.pad_token_id)
        self.tokenizer = tokenizer.backend_tokenizer
        self.truncate = spec.truncate
        self.num_labels = int(config.num_labels)
        # Segment ids only where the tokenizer hands them to the model (its model_input_names), as transformers
        # and sentence-transformers do: a model trained without them must not see them.
        self.segments = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        self.configure(spec)
        return self.open_runner(spec, device, safetensors)  # last: see ModelTask

    def configure(self, spec: ModelSpec) -> None:
        raise NotImplementedError

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, runner: Runner, batch: list[Encoded]) -> np.ndarray:
        """The task's outputs for a batch, the forward pass on ``runner`` (the accuracy gate passes torch's)."""
        ids, mask, types = self.collate(batch)
        with torch.inference_mode():
            return self.scores(runner(ids, mask, types).float()).cpu().numpy()
