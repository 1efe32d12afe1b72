"""SPLADE: texts in, one sparse vector over the model's vocabulary per text out (``TextOutputs.sparse``).

A sentence-transformers ``SparseEncoder`` folder (a ``*ForMaskedLM`` under a fill-mask Transformer, then
SpladePooling: core/tasks/st_folder.py), or any masked-LM folder with ``model.pooling: splade``. The weights are
sentence-transformers': ``log(1 + relu(logits))`` of each token's masked-LM logits, max over the text's tokens
(``pooling_strategy`` and ``activation_function`` as the folder says), computed inside the forward pass
(tasks/heads.py SpladeHead) so that a converted graph hands over ``[batch, vocab]`` and never the logits. Pruning is
the operator's: ``model.sparse_top_k`` keeps the largest weights, ``model.sparse_threshold`` drops those at or below
it; none set: every nonzero weight, as ``SparseEncoder.encode`` gives.

Memory: the masked-LM logits are ``batch x length x vocab`` floats (32 texts of 512 tokens over BERT's 30,522 ids:
2 GB); ``batching.max_batch_tokens`` bounds a batch's tokens, and so them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.core.description import Loaded, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.outputs import SparseVector, TextOutputs
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec
from inferd.core.tasks import st_files, st_folder, st_modules
from inferd.core.tasks.base import ModelTask, check_weights, dimension_refusal, length_limit, load_tokenizer
from inferd.core.tasks.embedding import folder_encoder
from inferd.core.tasks.heads import SpladeHead
from inferd.core.text_options import PLAIN_INPUTS, InputOptions


def is_splade(path: Path) -> bool:
    """Whether the folder is a SPLADE model by its modules (SpladePooling); an unreadable modules.json is left for
    the load to name."""
    try:
        return any(m.kind == "SpladePooling" for m in st_files.modules(path) or [])
    except ModelLoadError:
        return False


def vocabulary(tokenizer: Any, size: int) -> np.ndarray:
    """Each id's token text, ``size`` of them (the model's vocabulary, config.json ``vocab_size``; an id the
    tokenizer has no token for: "")."""
    out = np.full(size, "", dtype=object)
    for token, i in tokenizer.get_vocab().items():
        if 0 <= i < size:
            out[i] = token
    return out


def check_vocabulary(tokenizer: Any, size: int) -> None:
    """A model that weighs every id of its vocabulary (SPLADE) must have a token for each: ids past the tokenizer's
    (a vocabulary padded past it, or another model's tokenizer) would go out with no token text, matching no
    text's ids. (bge-m3's lexical weights are on the text's own ids: no such check.)"""
    known = {i for i in tokenizer.get_vocab().values() if 0 <= i < size}
    if len(known) < size:
        first = next(i for i in range(size) if i not in known)
        raise ModelLoadError(f"the model gives {size} weights per text (config.json vocab_size) but its tokenizer "
                             f"has a token for {len(known)} of those ids (none for {first}, ...): serve the model with "
                             "the tokenizer it was trained with")


class SparseHandler(ModelTask):
    """SPLADE weights from a masked-LM encoder, as the folder's SpladePooling (or ``model.pooling: splade``) says."""

    task = "embedding"
    inputs = "texts"
    head = "splade"
    outputs = ("sparse",)
    splade = st_modules.Splade()

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        folder = st_folder.read_folder(spec.path, spec.allow_pickle)
        if folder.pooling is not None and spec.pooling == "splade":
            raise ModelLoadError("model.pooling: splade, but the folder's Pooling module pools hidden states; SPLADE "
                                 "reads a masked-LM head's logits (serve the folder as it is, or a *ForMaskedLM)")
        safetensors = check_weights(spec.path, spec.allow_pickle)
        config, tokenizer = load_tokenizer(spec.path)
        archs = [str(a) for a in getattr(config, "architectures", None) or []]
        if not any(a.endswith("ForMaskedLM") for a in archs):
            raise ModelLoadError(f"SPLADE needs a masked-LM model (*ForMaskedLM); config.json names {archs or 'none'}")
        self.splade = folder.splade or st_modules.Splade()
        limit = length_limit(config, tokenizer, None)
        self.max_seq_length = min(spec.max_seq_length or folder.max_seq_length or limit, limit)
        self.dimension = int(config.vocab_size)
        self.pooling, self.normalize = "splade", False
        self.top_k, self.threshold = spec.settings.sparse_top_k, spec.settings.sparse_threshold
        self.pad_id = tokenizer.pad_token_id or 0
        check_vocabulary(tokenizer, self.dimension)
        self.vocab = vocabulary(tokenizer, self.dimension)
        self.prompts, self.default_prompt_name = folder.prompts, folder.default_prompt_name
        self.tokenizer, self.encoder = folder_encoder(tokenizer, folder, self.max_seq_length, spec, self.prompts)
        return self.open_runner(spec, device, safetensors)

    def head_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return SpladeHead(model, self.splade.strategy, self.splade.activation)

    def facts(self) -> TaskFacts:
        return TaskFacts(
            dimension=self.dimension, pooling="splade", normalize=False, similarity_fn_name="dot",
            prompts=dict(self.prompts), default_prompt_name=self.default_prompt_name,
            other={"outputs": list(self.outputs),
                   "splade": {"pooling_strategy": self.splade.strategy, "activation_function": self.splade.activation},
                   "sparse_top_k": self.top_k, "sparse_threshold": self.threshold})

    def incompatibility(self, serving: Any, allow_change: bool) -> str | None:
        return dimension_refusal(self.dimension, serving, allow_change)

    def preprocess(self, texts: list[str], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        return self.encoder.encode(texts, options)

    def forward(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        """The weights over the vocabulary ``[batch, vocab]`` (what the accuracy gate compares)."""
        ids, mask, _ = self.collate(batch)
        with torch.inference_mode():
            return runner(ids, mask).float().cpu().numpy()

    def forward_outputs(self, runner: Any, batch: list[Encoded]) -> dict[str, list[Any]]:
        rows = self.forward(runner, batch)
        return {"sparse": [(np.flatnonzero(r > 0), r[r > 0]) for r in rows]}

    def sparse(self, row: np.ndarray) -> SparseVector:
        nonzero = np.flatnonzero(row > 0)
        vector = SparseVector(nonzero.astype(np.int64), row[nonzero].astype(np.float32))
        if self.top_k is not None or self.threshold is not None:
            vector = vector.pruned(self.top_k, self.threshold)
        return SparseVector(vector.indices, vector.values, tuple(self.vocab[vector.indices]))

    def postprocess(self, outputs: np.ndarray) -> list[TextOutputs]:
        return [TextOutputs(sparse=self.sparse(row)) for row in outputs]

    def warmup(self) -> None:
        sample = self.preprocess(["warm up", "a somewhat longer sentence to warm up the padded path"])
        self.infer(sample)
