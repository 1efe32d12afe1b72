"""The torch modules a task puts on top of a model for the runner's ``splade`` and ``tokens`` heads
(backends/base.py): run eagerly by the torch backend and traced into the same graph by ONNX Runtime and OpenVINO,
so a converted model answers what torch does and the accuracy gate judges the heads with the encoder.

- ``SpladeHead``: ``log(1 + relu(logits))`` of the masked-LM logits (twice log1p for ``log1p_relu``), padding
  masked, max (or sum) over the text's tokens: sentence-transformers' SpladePooling, ``[batch, vocab]``.
- ``TokenHeads``: the encoder's last hidden state, then for each token ``relu(sparse_linear(h))`` (bge-m3's lexical
  weight) and ``colbert_linear(h)`` (its multi-vector, or a ColBERT projection), side by side
  ``[batch, length, hidden + 1 + dim]`` (a part the model lacks is left out); masking, special tokens and
  normalisation stay with the task, which knows which tokens a text's outputs keep.

Head weights a folder ships beside the model (bge-m3's ``sparse_linear.pt`` and ``colbert_linear.pt``) are read by
``linear_weights``: safetensors, or torch's weights-only loader, which unpickles tensors and plain containers and
nothing else; a file holding anything but a state dict of tensors is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inferd.core.backends.torch import accepts_token_type_ids
from inferd.core.errors import ModelLoadError


class HeadModule(torch.nn.Module):
    """What the exporters and runners need of the module under a head: its config and attention switch (the
    export traces eager attention, backends/base.py eager_attention) and whether it reads token_type_ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.takes_token_type_ids = accepts_token_type_ids(model)

    @property
    def config(self) -> Any:
        return self.model.config

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)

    def _run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             token_type_ids: torch.Tensor | None) -> Any:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and self.takes_token_type_ids:
            kwargs["token_type_ids"] = token_type_ids
        return self.model(**kwargs)


class SpladeHead(HeadModule):
    def __init__(self, model: torch.nn.Module, strategy: str = "max", activation: str = "relu") -> None:
        super().__init__(model)
        self.strategy = strategy
        self.twice = activation == "log1p_relu"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        logits = self._run(input_ids, attention_mask, token_type_ids).logits.float()
        # Masked to 0 before relu: a padded position weighs nothing, and every weight is >= 0, so max over the
        # row includes it harmlessly.
        weights = torch.log1p(torch.relu(logits * attention_mask.unsqueeze(-1).to(logits.dtype)))
        if self.twice:
            weights = torch.log1p(weights)
        return weights.amax(dim=1) if self.strategy == "max" else weights.sum(dim=1)


class TokenHeads(HeadModule):
    def __init__(self, model: torch.nn.Module, sparse: torch.nn.Module | None, colbert: torch.nn.Module | None,
                 keep_hidden: bool = True) -> None:
        super().__init__(model)
        self.sparse_linear = sparse
        self.colbert_linear = colbert
        self.keep_hidden = keep_hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self._run(input_ids, attention_mask, token_type_ids).last_hidden_state
        parts = [hidden] if self.keep_hidden else []
        if self.sparse_linear is not None:
            parts.append(torch.relu(self.sparse_linear(hidden)))
        if self.colbert_linear is not None:
            parts.append(self.colbert_linear(hidden))
        return torch.cat(parts, dim=-1).float()


def _state(path: Path, name: str) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except Exception as exc:  # the format's own errors name no path
            raise ModelLoadError(f"{name} cannot be read: {exc}") from None
    try:
        # weights_only: tensors and plain containers; a file naming any class to import is refused here.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(f"{name} cannot be read as weights ({type(exc).__name__}): it holds more than plain "
                             "tensors, which inferd does not unpickle") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ModelLoadError(f"{name} does not hold a state dict of tensors")
    return state


def linear_weights(folder: Path, stem: str, in_features: int) -> torch.nn.Linear | None:
    """The linear layer ``stem`` (``sparse_linear``) the folder ships as ``stem.safetensors`` or ``stem.pt``, checked
    to take ``in_features`` values; None when it ships neither."""
    path = next((folder / f"{stem}{ext}" for ext in (".safetensors", ".pt") if (folder / f"{stem}{ext}").is_file()),
                None)
    if path is None:
        return None
    state = _state(path, path.name)
    weight, bias = state.get("weight"), state.get("bias")
    if weight is None or weight.ndim != 2 or int(weight.shape[1]) != in_features:
        raise ModelLoadError(f"{path.name}: its weight must be a matrix taking the model's {in_features} hidden "
                             f"values, not {None if weight is None else list(weight.shape)}")
    if set(state) - {"weight", "bias"} or (bias is not None and tuple(bias.shape) != (weight.shape[0],)):
        raise ModelLoadError(f"{path.name}: a linear layer holds weight and bias only, of matching sizes")
    layer = torch.nn.Linear(in_features, int(weight.shape[0]), bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight.float())
        if bias is not None:
            layer.bias.copy_(bias.float())
    return layer
