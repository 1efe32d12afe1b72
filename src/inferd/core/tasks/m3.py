"""bge-m3's three outputs from one forward pass: a dense vector, lexical weights (sparse) and token vectors
(multi-vector), for any subset a text asks for (core/outputs.py ``asked``).

The folder is an XLM-RoBERTa encoder with its heads beside it: ``sparse_linear`` (hidden -> 1) and
``colbert_linear`` (hidden -> dim), as ``.pt`` (torch's weights-only loader: tensors only) or ``.safetensors``
(tasks/heads.py). As BAAI's reference (FlagEmbedding's M3 embedder) computes them:

- dense: the folder's pooling and Normalize (bge-m3's: the first token, normalised; cls + Normalize without
  sentence-transformers files);
- sparse: ``relu(sparse_linear(h))`` per token, the largest per token id, the tokenizer's cls, eos, pad and unk ids
  dropped, zeros dropped;
- multi-vector: ``colbert_linear(h)`` of every token after the first (the eos included) up to the text's end,
  each normalised.

A text that asks for nothing is answered with its dense vector alone (a bare vector, as every embedding route
takes); one that asks (``outputs``) gets ``TextOutputs`` with exactly those outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.core.description import Loaded, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.families import family_of
from inferd.core.outputs import SparseVector, TextOutputs, asked, sparse_from_weights
from inferd.core.preprocess import Encoded, InputError
from inferd.core.spec import ModelSpec
from inferd.core.tasks import st_folder, st_modules
from inferd.core.tasks.base import TokenVectorTask, check_weights, dimension_refusal, length_limit, load_tokenizer
from inferd.core.tasks.embedding import POOLERS, PooledHead, folder_encoder, head_steps
from inferd.core.tasks.heads import TokenHeads, linear_weights
from inferd.core.tasks.sparse import vocabulary
from inferd.core.text_options import PLAIN_INPUTS, InputOptions

HEAD_FILES = ("sparse_linear", "colbert_linear")


def has_heads(path: Path) -> bool:
    """Whether the folder ships bge-m3's sparse or ColBERT head beside its encoder."""
    return any((path / f"{stem}{ext}").is_file() for stem in HEAD_FILES for ext in (".pt", ".safetensors"))


@dataclass(frozen=True, slots=True)
class Asked(Encoded):
    """A tokenised text and the outputs it asked for (empty: none named, its dense vector alone)."""

    outputs: tuple[str, ...] = ()


def special_ids(tokenizer: Any) -> set[int]:
    """The ids lexical weights leave out: the tokenizer's cls, eos, pad and unk tokens, as BAAI's reference does."""
    out = set()
    for name in ("cls_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            out.add(value)
    return out


class M3Handler(TokenVectorTask):
    """Dense, sparse and multi-vector outputs of a bge-m3-shaped folder, from one forward pass."""

    task = "embedding"
    inputs = "texts"
    head = "tokens"

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        folder = st_folder.read_folder(spec.path, spec.allow_pickle)
        safetensors = check_weights(spec.path, spec.allow_pickle)
        family = family_of(spec.path)
        if family.kind != "encoder":
            # The heads read every token's state from an encoder that saw the whole text, and the dense vector is
            # the first token's: a decoder's first token has seen only itself.
            raise ModelLoadError(f"sparse_linear / colbert_linear are bge-m3's heads over an encoder; this model is "
                                 f"a {family.name} decoder")
        config, tokenizer = load_tokenizer(spec.path)
        self.hidden = hidden = int(config.hidden_size)
        self.sparse_linear = linear_weights(spec.path, "sparse_linear", hidden)
        self.colbert_linear = linear_weights(spec.path, "colbert_linear", hidden)
        if self.sparse_linear is not None and self.sparse_linear.out_features != 1:
            raise ModelLoadError(f"sparse_linear gives {self.sparse_linear.out_features} values per token; a lexical "
                                 "weight is one")
        self.outputs = ("dense",) + (("sparse",) if self.sparse_linear is not None else ()) + (
            ("multivector",) if self.colbert_linear is not None else ())
        self.max_token_vectors = spec.max_token_vectors
        limit = length_limit(config, tokenizer, None)
        self.max_seq_length = min(spec.max_seq_length or folder.max_seq_length or limit, limit)
        # bge-m3 without sentence-transformers files: its first token, normalised (BAAI's reference).
        self.pooling_modes = (spec.pooling,) if spec.pooling else folder.pooling or ("cls",)
        if any(m not in POOLERS for m in self.pooling_modes):
            raise ModelLoadError(f"model.pooling {spec.pooling!r} is not a pooling of hidden states")
        normalize = True if spec.normalize is None and not folder.pooling else spec.normalize
        steps, self.dimension = head_steps(folder, self.pooling_modes, hidden, normalize)
        self.normalize = bool(steps) and isinstance(steps[-1], st_modules.Normalize)
        self._dense = PooledHead(steps).eval() if steps else None
        self.colbert_dim = 0 if self.colbert_linear is None else self.colbert_linear.out_features
        self.unused = special_ids(tokenizer)
        self.vocab = vocabulary(tokenizer, int(config.vocab_size))
        self.pad_id = tokenizer.pad_token_id or 0
        self.prompts, self.default_prompt_name = folder.prompts, folder.default_prompt_name
        self.tokenizer, self.encoder = folder_encoder(tokenizer, folder, self.max_seq_length, spec, self.prompts,
                                                      exclude_prompt=not folder.include_prompt)
        return self.open_runner(spec, device, safetensors)

    def head_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return TokenHeads(model, self.sparse_linear, self.colbert_linear)

    def facts(self) -> TaskFacts:
        return TaskFacts(
            dimension=self.dimension, pooling="+".join(self.pooling_modes), normalize=self.normalize,
            similarity_fn_name="cosine", prompts=dict(self.prompts), default_prompt_name=self.default_prompt_name,
            other={"outputs": [*self.outputs, "token_states"], "multivector_dimension": self.colbert_dim or None,
                   "include_prompt": not self.encoder.exclude_prompt})

    def incompatibility(self, serving: Any, allow_change: bool) -> str | None:
        return dimension_refusal(self.dimension, serving, allow_change)

    def encode_texts(self, texts: list[str], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        out: list[Encoded] = []
        each = options.per_text(len(texts))
        for i, enc in enumerate(self.encoder.encode(texts, options)):
            wanted = asked(each[i], ())
            gives = (*self.outputs, "token_states")  # its encoder's last hidden states too (TEI's /embed_all)
            missing = [k for k in wanted if k not in gives]
            if missing:
                raise InputError(i, f"asks for {', '.join(missing)}; this model gives {', '.join(gives)}",
                                 "unsupported_output")
            out.append(Asked(enc.ids, enc.truncated, enc.type_ids, enc.skip, wanted) if wanted else enc)
        return out

    def token_vectors(self, item: Encoded) -> int:
        # Every token after the first, up to the text's end (multivector below); every token for its states.
        if not isinstance(item, Asked):
            return 0
        return (item.tokens - 1 if "multivector" in item.outputs else 0) + (
            item.tokens if "token_states" in item.outputs else 0)

    def tokens(self, runner: Any, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's token outputs ``[batch, length, hidden + 1 + dim]`` and the attention mask."""
        ids, mask, _ = self.collate(batch)
        with torch.inference_mode():
            return runner(ids, mask).float().cpu(), mask

    def dense(self, out: torch.Tensor, mask: torch.Tensor, batch: list[Encoded]) -> np.ndarray:
        hidden = out[..., : self.hidden]
        keep = mask
        if any(e.skip for e in batch):
            skip = torch.tensor([e.skip for e in batch]).unsqueeze(1)
            keep = mask * (mask.cumsum(dim=1) > skip)
        with torch.inference_mode():
            pooled = torch.cat([POOLERS[m](hidden, keep, mask) for m in self.pooling_modes], dim=-1)
            if self._dense is not None:
                pooled = self._dense(pooled)
        return pooled.numpy()

    def forward(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        """The dense vectors (what the accuracy gate compares as an embedding's)."""
        out, mask = self.tokens(runner, batch)
        return self.dense(out, mask, batch)

    def forward_outputs(self, runner: Any, batch: list[Encoded]) -> dict[str, list[Any]]:
        out, mask = self.tokens(runner, batch)
        parts: dict[str, list[Any]] = {"dense": list(self.dense(out, mask, batch))}
        if "sparse" in self.outputs:
            lexical = [self.lexical(e.ids, out[row, : e.tokens, self.hidden].numpy()) for row, e in enumerate(batch)]
            parts["sparse"] = [(v.indices, v.values) for v in lexical]
        if "multivector" in self.outputs:
            parts["multivector"] = [self.multivector(out[row, 1: e.tokens, -self.colbert_dim:])
                                    for row, e in enumerate(batch)]
        return parts

    def infer(self, batch: list[Encoded]) -> tuple[list[Encoded], torch.Tensor, np.ndarray]:
        out, mask = self.tokens(self.runner, batch)
        return batch, out, self.dense(out, mask, batch)

    def postprocess(self, outputs: tuple[list[Encoded], torch.Tensor, np.ndarray]) -> list[Any]:
        batch, out, dense = outputs
        results: list[Any] = []
        for row, enc in enumerate(batch):
            wanted = enc.outputs if isinstance(enc, Asked) else ()
            if not wanted:
                results.append(dense[row])
                continue
            results.append(TextOutputs(
                dense=dense[row] if "dense" in wanted else None,
                sparse=self.lexical(enc.ids, out[row, : enc.tokens, self.hidden].numpy())
                if "sparse" in wanted else None,
                multivector=self.multivector(out[row, 1: enc.tokens, -self.colbert_dim:])
                if "multivector" in wanted else None,
                token_states=np.ascontiguousarray(out[row, : enc.tokens, : self.hidden].numpy())
                if "token_states" in wanted else None))
        return results

    def lexical(self, ids: list[int], weights: np.ndarray) -> SparseVector:
        kept = [(i, w) for i, w in zip(ids, weights, strict=True) if i not in self.unused]
        vector = sparse_from_weights([i for i, _ in kept], [w for _, w in kept])
        return SparseVector(vector.indices, vector.values, tuple(self.vocab[vector.indices]))

    def multivector(self, vectors: torch.Tensor) -> np.ndarray:
        return torch.nn.functional.normalize(vectors, p=2, dim=-1).numpy()

    def warmup(self) -> None:
        sample = self.preprocess(["warm up", "a somewhat longer sentence to warm up the padded path"])
        self.infer(sample)
