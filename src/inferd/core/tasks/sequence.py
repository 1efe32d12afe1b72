"""What the rerank and classification tasks share: a ``*ForSequenceClassification`` model, run on the
device, giving one row of logits per input (a text, or a query/document pair with segment ids)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from inferd.core.preprocess import Encoded
from inferd.core.tasks.base import ModelLoadError, ModelSpec, check_weights, length_limit, load_tokenizer

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class SequenceClassifier:
    """Loads the folder's sequence-classification head and runs it; subclasses say what a row of logits means."""

    def load(self, spec: ModelSpec, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification

        if spec.backend != "torch":
            raise ModelLoadError(f"model.backend {spec.backend!r} serves embedding models only; "
                                 f"{spec.path} is a {self.task} model: use model.backend: torch")
        safetensors = check_weights(spec.path, spec.allow_pickle)
        config, tokenizer = load_tokenizer(spec.path)
        # Half precision only where it pays (a GPU); on the CPU float32 is faster as well as exact.
        dtype = _DTYPES.get(spec.dtype, torch.float32) if device.type == "cuda" else torch.float32
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                spec.path, local_files_only=True, use_safetensors=safetensors, dtype=dtype)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load {spec.path} as a sequence classifier: {exc}") from exc
        self.model = model.to(device).eval()
        self.config = config
        self.name, self.version = spec.name, spec.version
        self.max_seq_length = length_limit(config, tokenizer, spec.max_seq_length)
        self.pad_id = tokenizer.pad_token_id or 0
        self.tokenizer = tokenizer.backend_tokenizer
        self.truncate = spec.truncate
        self.device, self.dtype = device, str(dtype).removeprefix("torch.")
        self.num_labels = int(config.num_labels)
        # Segment ids only where the tokenizer hands them to the model (its model_input_names), as transformers
        # and sentence-transformers do: a model trained without them must not see them.
        self._types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())

    def logits(self, batch: list[Encoded]) -> torch.Tensor:
        """The head's float32 logits for a padded batch (padding is masked, so a row never sees another)."""
        longest = max(e.tokens for e in batch)
        ids = np.full((len(batch), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), longest), dtype=np.int64)
        types = np.zeros((len(batch), longest), dtype=np.int64)
        for row, enc in enumerate(batch):
            ids[row, : enc.tokens] = enc.ids
            mask[row, : enc.tokens] = 1
            if enc.type_ids is not None:
                types[row, : enc.tokens] = enc.type_ids
        inputs: dict[str, Any] = {"input_ids": torch.from_numpy(ids).to(self.device),
                                  "attention_mask": torch.from_numpy(mask).to(self.device)}
        if self._types:
            inputs["token_type_ids"] = torch.from_numpy(types).to(self.device)
        with torch.inference_mode():
            return self.model(**inputs).logits.float()

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
