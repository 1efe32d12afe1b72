"""Attention masks built outside the traced graph, for decoders whose attention looks both ways.

A decoder configured with ``use_bidirectional_attention`` (EmbeddingGemma: Gemma3's text model, every token
seeing every other, its sliding-window layers within the window on both sides) has transformers build its masks
from Python mask functions evaluated under ``torch.vmap``. The exporters trace the module, and tracing cannot
record vmap: both converters failed inside the tracer ("unordered_map::at"), while the same folder with causal
attention exported. Such a model's forward takes its masks ready-made (a dict from layer kind to a 4-D mask, as
``generate`` hands it), so the export wrapper builds them here, from the 2-D padding mask, with plain tensor
operations the tracer records; the graph then computes what torch computes (the accuracy gate compares them).

The masks are additive (0 where a key is seen, the dtype's minimum where not), as transformers' eager attention
takes them, which is what a model is traced with (backends/base.py ``eager_attention``).
"""

from __future__ import annotations

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


def bidirectional(model: torch.nn.Module) -> bool:
    """Whether the model's attention looks both ways and its masks are to be built outside the graph."""
    config = getattr(model, "config", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    return bool(getattr(config, "use_bidirectional_attention", False)) and bool(kinds) and kinds <= {FULL, SLIDING}


def prepared(model: torch.nn.Module, attention_mask: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The masks of each layer kind the model has, ``[batch, 1, length, length]``: a full-attention layer sees every
    key that is not padding, a sliding-window layer those whose distance from the query is under the window."""
    config = model.config  # type: ignore[union-attr]
    keys = attention_mask.bool()[:, None, None, :]
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    full = keys.expand(-1, -1, attention_mask.shape[1], -1)
    window = getattr(config, "sliding_window", None)
    near = (positions[:, None] - positions[None, :]).abs() < window if window else None
    masks = {kind: full if kind == FULL or near is None else keys & near[None, None]
             for kind in set(config.layer_types)}
    lowest = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return {kind: torch.where(seen, zero, lowest) for kind, seen in masks.items()}
