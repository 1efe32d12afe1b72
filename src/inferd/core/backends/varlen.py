"""Unpadded ("varlen") torch forward pass for BERT encoders: only the real tokens are computed.

A padded batch pays for every padded position in every layer: a text of 20 tokens batched with one of 256
costs as much as a text of 256. Here every token-wise layer (embeddings, the Q/K/V and output projections,
the layer norms, the feed-forward) runs once over the real tokens of the whole batch, packed into one
``[tokens, hidden]`` matrix, and attention, the only part that mixes tokens, runs per sequence on that
sequence's slice. This is how text-embeddings-inference runs encoders on GPUs; bench/padding.py measures it
against padded torch, ONNX Runtime, OpenVINO and nested tensors on the CPU.

The forward pass is written over the loaded transformers ``BertModel``'s own modules (its weights, layer-norm
epsilons and activation), in the same order of operations, so its outputs match the padded forward pass
(cosine >= 0.9999, tests/unit/test_varlen.py). It is returned in the padded ``[batch, length, hidden]``
shape the task pools, with zeros at padded positions, so the task calls it like any runner. A
``BertForSequenceClassification`` (the ``logits`` head: cross-encoders, classifiers) runs its encoder the
same way and its own pooler and classifier on each sequence's first token, which is all that head reads.

Llama-shaped decoders (Qwen2, Qwen3, Llama, Mistral: decoder embedders and LLM rerankers, the ``hidden`` head) run
the same way: RMS norms, projections and the gated feed-forward over the packed tokens, rotary positions counted
within each text, causal attention per text (grouped key/value heads expanded by the kernel). What packing saves is
the padded positions' work: much in a batch of mixed lengths, nothing for one text or texts of one length; the
outputs are the padded pass's (tests/unit/test_varlen.py holds each family to it within 1e-5). Gemma is left
to the padded path (scaled embeddings, soft-capping, sliding windows are not written here), as is any decoder
with a sliding-window layer (a text longer than the window would differ).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own convention)

from inferd.core.backends.base import BackendError
from inferd.core.backends.torch import TorchRunner
from inferd.core.capabilities import Capabilities

# Architectures whose embeddings and layers are BERT's, position ids included (RoBERTa has BERT's modules
# but counts positions from the padding id, which packing would change): checked, not guessed.
ARCHITECTURES = ("bert",)
# Decoders whose layers are Llama's (Qwen3 adds a norm on each head's query and key): checked, not guessed.
DECODERS = ("qwen2", "qwen3", "llama", "mistral")


@dataclass(frozen=True)
class Packed:
    """Where a padded batch's real tokens are: row-major flat positions and each row's slice."""

    index: torch.Tensor  # flat positions (row * length + column) of the kept tokens, in row-major order
    offsets: tuple[int, ...]  # row i's tokens are packed rows offsets[i]:offsets[i + 1]
    keep: torch.Tensor  # the boolean mask, [batch, length]
    full: bool  # no padding at all (one text, or texts of one length): packing is a reshape

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.keep.shape[0]), int(self.keep.shape[1])


def pack(mask: torch.Tensor) -> Packed:
    keep = mask.bool()
    index = keep.reshape(-1).nonzero().squeeze(1)
    offsets = (0, *torch.cumsum(keep.sum(dim=1), 0).tolist())
    return Packed(index, offsets, keep, offsets[-1] == keep.numel())


# attention(query, key, value, packed, heads) -> context; the projections are [tokens, hidden].
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Packed, int], torch.Tensor]


def _batched(t: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """[batch * length, hidden] as [batch, heads, length, size] (a view)."""
    return t.view(batch, -1, heads, t.shape[1] // heads).transpose(1, 2)


def _unbatched(ctx: torch.Tensor) -> torch.Tensor:
    batch, heads, length, size = ctx.shape
    return ctx.transpose(1, 2).reshape(batch * length, heads * size)


def attention_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed,
                           heads: int) -> torch.Tensor:
    """Each sequence attends over its own slice only: no mask, nothing padded; one call per sequence."""
    if packed.full:  # rows of one length: one batched call is the same computation
        batch = packed.shape[0]
        return _unbatched(F.scaled_dot_product_attention(*(_batched(t, batch, heads) for t in (q, k, v))))
    size = q.shape[1] // heads
    out = torch.empty_like(q)
    for start, end in zip(packed.offsets, packed.offsets[1:], strict=False):
        n = end - start
        if n == 0:
            continue
        # [heads, tokens, size] views of this sequence's slice: no copy before the kernel.
        qs, ks, vs = (t[start:end].view(n, heads, size).transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(n, heads * size)
    return out


def attention_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed,
                     heads: int) -> torch.Tensor:
    """One masked call over the projections scattered back to [batch, heads, longest, size]: the padded
    positions cost attention (a small share of an encoder layer's work at these lengths), and none of the
    per-sequence calls' overhead."""
    batch = packed.shape[0]
    if packed.full:
        return _unbatched(F.scaled_dot_product_attention(*(_batched(t, batch, heads) for t in (q, k, v))))
    ctx = F.scaled_dot_product_attention(*(_batched(unpack(t, packed).view(-1, t.shape[1]), batch, heads)
                                           for t in (q, k, v)), attn_mask=packed.keep[:, None, None, :])
    return _unbatched(ctx)[packed.index]


# The sequence-classification heads whose pooler and classifier read the first token only.
HEADS = ("BertForSequenceClassification",)


def encoder_of(model: torch.nn.Module) -> Any:
    """The bare encoder inside a sequence classifier, or the model itself."""
    return model.bert if type(model).__name__ in HEADS else model


def decoder_unsupported(model: torch.nn.Module) -> str | None:
    """Why this decoder cannot run unpadded, or None."""
    config = getattr(model, "config", None)
    if not all(hasattr(model, m) for m in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} is not a bare decoder (embed_tokens, layers, norm, rotary_emb)"
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in model.layers):
        return "a layer attends within a sliding window, which unpadded attention does not apply"
    implementation = getattr(config, "_attn_implementation", "sdpa")
    if implementation not in ("sdpa", "eager"):
        return f"the model is loaded with {implementation!r} attention"
    return None


def unsupported(model: torch.nn.Module, head: str = "hidden") -> str | None:
    """Why this module cannot run unpadded, or None."""
    if head not in ("hidden", "logits"):
        return f"unpadded execution is written for the hidden and logits heads, not a task's {head} head"
    if head == "hidden" and getattr(getattr(model, "config", None), "model_type", None) in DECODERS:
        return decoder_unsupported(model)
    if head == "logits" and type(model).__name__ not in HEADS:
        return f"unpadded execution of a classification head is written for {', '.join(HEADS)}, not " \
               f"{type(model).__name__}"
    if head == "logits" and getattr(encoder_of(model), "pooler", None) is None:
        return "the classification head reads BERT's pooler, and this model has none"
    model = encoder_of(model)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return (f"unpadded execution is written for {', '.join(ARCHITECTURES)} encoders and "
                f"{', '.join(DECODERS)} decoders; this model is {kind!r}")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "unpadded execution is for encoders; this BERT is configured as a decoder"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"unpadded execution needs absolute positions, not {config.position_embedding_type!r}"
    if not (hasattr(model, "embeddings") and hasattr(model, "encoder")):
        return f"{type(model).__name__} is not a bare encoder (no embeddings/encoder modules)"
    return None


def embed(model: Any, ids: torch.Tensor, token_type_ids: torch.Tensor | None, packed: Packed) -> torch.Tensor:
    """BERT's embeddings for the kept tokens: word + segment + absolute position (the column), normalised."""
    emb = model.embeddings
    length = packed.shape[1]
    x = emb.word_embeddings(ids.reshape(-1) if packed.full else ids.reshape(-1)[packed.index])
    if token_type_ids is None:
        x = x + emb.token_type_embeddings.weight[0]  # what transformers' all-zero segment buffer selects
    else:
        x = x + emb.token_type_embeddings(token_type_ids.reshape(-1)[packed.index])
    x = x + emb.position_embeddings(packed.index % length)
    return emb.LayerNorm(x)


def encode(model: Any, x: torch.Tensor, packed: Packed, attention: Attention) -> torch.Tensor:
    """The encoder layers over packed tokens, as transformers' BertLayer orders them (post-norm)."""
    for layer in model.encoder.layer:
        sa = layer.attention.self
        ctx = attention(sa.query(x), sa.key(x), sa.value(x), packed, sa.num_attention_heads)
        x = layer.attention.output.LayerNorm(layer.attention.output.dense(ctx) + x)
        hidden = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(x))
        x = layer.output.LayerNorm(layer.output.dense(hidden) + x)
    return x


def unpack(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The packed rows back in the padded shape, zeros where the batch was padded."""
    batch, length = packed.shape
    if packed.full:
        return x.view(batch, length, x.shape[1])
    out = x.new_zeros(batch * length, x.shape[1])
    out[packed.index] = x
    return out.view(batch, length, x.shape[1])


def forward(model: Any, ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor | None = None,
            attention: Attention = attention_per_sequence) -> torch.Tensor:
    """The last hidden state of a padded batch, computed on its real tokens only."""
    packed = pack(mask)
    x = encode(model, embed(model, ids, token_type_ids, packed), packed, attention)
    return unpack(x, packed)


def classify(model: Any, ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor | None = None,
             attention: Attention = attention_per_sequence) -> torch.Tensor:
    """A BertForSequenceClassification's float32 logits, its encoder run on real tokens only: BERT's pooler
    (dense + tanh over the first token) and the classifier, as transformers' forward (dropout is off in eval)."""
    bert = model.bert
    packed = pack(mask)
    x = encode(bert, embed(bert, ids, token_type_ids, packed), packed, attention)
    first = x[list(packed.offsets[:-1])]  # each sequence's first token ([CLS]); every row has one
    pooled = bert.pooler.activation(bert.pooler.dense(first))
    return model.classifier(pooled).float()


def _rotary(model: torch.nn.Module) -> Any:
    """The model's own apply_rotary_pos_emb (each family's modeling module defines it)."""
    return sys.modules[type(model).__module__].apply_rotary_pos_emb


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed,
                      spans: list[tuple[int, int]], scale: float) -> torch.Tensor:
    """Causal attention within each text: [1, heads, tokens, size] in, [tokens, heads * size] out."""
    if packed.full:  # texts of one length: one batched call is the same computation
        batch, length = packed.shape
        q, k, v = (t[0].view(t.shape[1], batch, length, -1).transpose(0, 1) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return ctx.transpose(1, 2).reshape(batch * length, -1)
    ctx = torch.empty_like(q)
    for start, end in spans:
        if end > start:
            ctx[..., start:end, :] = F.scaled_dot_product_attention(
                q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], is_causal=True, scale=scale,
                enable_gqa=True)
    return ctx[0].transpose(0, 1).reshape(q.shape[2], -1)


def decoder_forward(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A decoder's last hidden state (after the final norm) of a padded batch, computed on its real tokens only."""
    packed = pack(mask)
    keep = packed.keep
    # Each real token's place in its own text, whichever side the padding is on.
    positions = (keep.cumsum(dim=1) - 1).reshape(-1)[packed.index]
    x = model.embed_tokens(ids.reshape(-1)[packed.index])
    cos, sin = model.rotary_emb(x[None], positions[None])
    rotate = _rotary(model)
    spans = list(zip(packed.offsets, packed.offsets[1:], strict=False))
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        size = attn.head_dim
        q = attn.q_proj(h).view(h.shape[0], -1, size)
        k = attn.k_proj(h).view(h.shape[0], -1, size)
        v = attn.v_proj(h).view(h.shape[0], -1, size)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's query and key before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotate(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        v = v.transpose(0, 1)[None]
        x = x + attn.o_proj(_causal_attention(q, k, v, packed, spans, attn.scaling))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return unpack(model.norm(x), packed)


def choose(setting: str, model: torch.nn.Module, device: torch.device, head: str = "hidden") -> tuple[bool, str]:
    """Whether the torch backend runs this model unpadded (``model.unpadded``), and why (for the log and /info).

    ``auto`` means: unpadded for a BERT encoder (bench/padding.py measured it) or a Llama-shaped decoder (see
    above) on the CPU; padded on a GPU
    (not measured: a loop of small attention calls may cost more there than the padding it saves) and for
    any other architecture. ``true`` insists and refuses a model it cannot run.
    """
    reason = unsupported(model, head)
    if setting == "false":
        return False, "model.unpadded: false"
    if setting == "true":
        if reason is not None:
            raise BackendError(f"model.unpadded: true, but {reason} (set model.unpadded: auto or false)")
        return True, "model.unpadded: true"
    if reason is not None:
        return False, f"auto: {reason}"
    if device.type != "cpu":
        return False, f"auto: padded on {device.type} (unpadded execution is measured on the CPU only)"
    if getattr(getattr(model, "config", None), "model_type", None) in DECODERS:
        return True, "auto: a Llama-shaped decoder on the CPU runs on its real tokens only"
    return True, "auto: a BERT encoder on the CPU runs on its real tokens only"


class VarlenRunner(TorchRunner):
    """The torch backend without padding cost (``model.unpadded``): same weights, dtype and autocast rules
    as TorchRunner, a forward pass over real tokens only."""

    capabilities = Capabilities(pads=False)  # on a CUDA device, staged as TorchRunner's are

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: str = "float32",
                 info: dict[str, Any] | None = None, head: str = "hidden") -> None:
        reason = unsupported(model, head)
        if reason is not None:
            raise BackendError(f"model.unpadded: {reason} (set model.unpadded: false or auto)")
        super().__init__(model, device, dtype, info, head)
        self.info["unpadded"] = True

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        assert self.model is not None
        if self.head == "logits":
            return classify(self.model, ids, mask, segments)
        if getattr(self.model.config, "model_type", None) in DECODERS:
            return decoder_forward(self.model, ids, mask)
        return forward(self.model, ids, mask, segments)
