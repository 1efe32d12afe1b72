"""The embedding task: texts in, one pooled vector per text out (/v1/embeddings, /predict, TEI's /embed, Cohere's
/v1/embed and /v2/embed).

What the model folder's sentence-transformers files say (core/tasks/st_folder.py) is run here: the pooling
modes on the hidden states any runner gives (torch, unpadded, ONNX Runtime, OpenVINO: pooling and what follows it
stay in the task), then the folder's Dense layers and Normalize on the pooled vector. Its **prompts** are
prepended by admission (core/text_options.py TextOptions.prompt); a pooling with ``include_prompt: false`` leaves the
prompt's tokens out, as ``SentenceTransformer.encode(prompt_name=...)`` does; a prompt that cannot fit the
text limits refuses the model at load (check_prompts), where the fault is the model's, not a client's. Whether
its vectors may be cut short (**Matryoshka**): ``model.matryoshka_dimensions`` (a list, or ``any``), else its
model card when it was trained with ``MatryoshkaLoss`` (the ``loss:MatryoshkaLoss`` tag and the loss's
``matryoshka_dims`` that sentence-transformers writes into README.md), else none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, normalizers

from inferd.core.description import Loaded, ModelDescription, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.families import default_pooling
from inferd.core.outputs import TextOutputs
from inferd.core.preprocess import Encoded, TextEncoder
from inferd.core.spec import ModelSpec
from inferd.core.tasks import st_folder, st_modules
from inferd.core.tasks.base import ModelTask, check_weights, dimension_refusal, length_limit, load_tokenizer
from inferd.core.tasks.token_states import WithStates, asks_states, mark, states_of
from inferd.core.text_options import PLAIN_INPUTS, InputOptions

# Every pooler takes the hidden states [batch, length, hidden], the mask of the tokens to pool (a prompt left out
# of pooling is 0 there) and the attention mask (the tokens the model saw; None: the same). Padding may sit on
# either side (decoders pad on the left), so no pooler assumes a row's tokens start at position 0.


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor | None = None) -> torch.Tensor:
    """Average of the token vectors that the mask keeps (padding excluded)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


def mean_sqrt_len_pool(hidden: torch.Tensor, mask: torch.Tensor,
                       attention: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of the kept token vectors over the square root of their count (sentence-transformers'
    ``mean_sqrt_len_tokens``)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9).sqrt()


def cls_pool(hidden: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor | None = None) -> torch.Tensor:
    """The first token the mask keeps (the first of all, unless a prompt is left out: sentence-transformers')."""
    first = mask.to(torch.int).argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), first.to(hidden.device)]


def max_pool(hidden: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor | None = None) -> torch.Tensor:
    """The largest value of each component over the kept tokens; a row with none kept is zeros (-inf would
    serve a vector no client can parse)."""
    keep = mask.unsqueeze(-1).bool()
    out = hidden.masked_fill(~keep, float("-inf")).max(dim=1).values
    return out.masked_fill(~keep.any(dim=1), 0.0)


def weightedmean_pool(hidden: torch.Tensor, mask: torch.Tensor,
                      attention: torch.Tensor | None = None) -> torch.Tensor:
    """Kept tokens weighted by their position, counted from the row's first attended token (1, 2, ...): a
    prompt left out of pooling keeps its place in the count, as sentence-transformers does."""
    seen = mask if attention is None else attention
    weights = seen.to(hidden.dtype).cumsum(dim=1) * mask.to(hidden.dtype)
    w = weights.unsqueeze(-1)
    return (hidden * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9)


def lasttoken_pool(hidden: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor | None = None) -> torch.Tensor:
    """The last token the mask keeps, whichever side the padding is on (a decoder embedder's, whose last
    token has seen the whole text); a row with none kept is zeros, as sentence-transformers gives."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values.to(hidden.device)
    out = hidden[torch.arange(hidden.shape[0], device=hidden.device), last.clamp(min=0)]
    return out * (last >= 0).unsqueeze(-1).to(out.dtype)


# By sentence-transformers' names for the modes (``Pooling.POOLING_MODES``).
POOLERS = {"cls": cls_pool, "max": max_pool, "mean": mean_pool, "mean_sqrt_len_tokens": mean_sqrt_len_pool,
           "weightedmean": weightedmean_pool, "lasttoken": lasttoken_pool}


class PooledHead(torch.nn.Module):
    """What follows pooling, in the folder's order: its Dense layers and Normalize, in float32."""

    def __init__(self, steps: list[st_modules.Dense | st_modules.Normalize]) -> None:
        super().__init__()
        self.steps = torch.nn.ModuleList(_DenseLayer(s) if isinstance(s, st_modules.Dense) else _Normalize()
                                         for s in steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


class _DenseLayer(torch.nn.Module):
    def __init__(self, dense: st_modules.Dense) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dense.in_features, dense.out_features, bias=dense.bias is not None)
        self.activation = st_modules.ACTIVATIONS[dense.activation]()
        self.residual = dense.residual
        self.project = None
        with torch.no_grad():
            self.linear.weight.copy_(dense.weight)
            if dense.bias is not None:
                self.linear.bias.copy_(dense.bias)
            if dense.residual_weight is not None:
                self.project = torch.nn.Linear(dense.in_features, dense.out_features, bias=False)
                self.project.weight.copy_(dense.residual_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.residual:
            out = out + (x if self.project is None else self.project(x))
        return out


class _Normalize(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(x, p=2, dim=-1)


def head_steps(folder: st_folder.STFolder, modes: tuple[str, ...], hidden: int, normalize: bool | None
               ) -> tuple[list[st_modules.Dense | st_modules.Normalize], int]:
    """The steps after pooling (``model.normalize`` adds or drops the last normalisation) and the size of the
    vector they give, each Dense checked against the size it is handed."""
    if folder.embedding_dimension is not None and folder.embedding_dimension != hidden:
        raise ModelLoadError(f"the Pooling module pools {folder.embedding_dimension}-dimensional token vectors; "
                             f"the model's hidden size is {hidden}")
    steps = list(folder.after)
    if normalize is False:
        while steps and isinstance(steps[-1], st_modules.Normalize):
            steps.pop()
    elif normalize and not (steps and isinstance(steps[-1], st_modules.Normalize)):
        steps.append(st_modules.Normalize("model.normalize"))
    size = hidden * len(modes)
    for step in steps:
        if isinstance(step, st_modules.Dense):
            if step.in_features != size:
                raise ModelLoadError(f"the Dense module {step.path} takes {step.in_features} values; pooling "
                                     f"({'+'.join(modes)}) gives {size}")
            size = step.out_features
    return steps, size


def _lowercases(normalizer: Any) -> bool:
    if normalizer is None:
        return False
    if isinstance(normalizer, normalizers.Lowercase):
        return True
    if isinstance(normalizer, normalizers.BertNormalizer):
        return bool(normalizer.lowercase)
    if isinstance(normalizer, normalizers.Sequence):
        parts, i = [], 0
        while True:  # a Sequence indexes but does not iterate
            try:
                parts.append(normalizer[i])
            except IndexError:
                break
            i += 1
        return any(_lowercases(p) for p in parts)
    return False


def lowercase_first(tokenizer: Tokenizer) -> None:
    """sentence-transformers' ``do_lower_case``: a Lowercase normaliser ahead of the tokenizer's own, unless it
    lowercases already (as sentence-transformers 6 does it, so the ids are the same)."""
    current = tokenizer.normalizer
    if not _lowercases(current):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *([] if current is None else [current])])


def check_prompts(prompts: Mapping[str, str], encoder: TextEncoder, max_chars: int) -> None:
    """A prompt is prepended to every text it applies to: one longer than the longest text a client may send,
    or one that leaves no token for the text, would make every request fail or embed the prompt alone, so
    the model is refused, naming it."""
    for name, prompt in prompts.items():
        if len(prompt) > max_chars:
            raise ModelLoadError(f"prompt {name!r} of config_sentence_transformers.json is {len(prompt)} characters "
                                 f"long, longer than a text may be ({max_chars}, limits.max_chars_per_text)")
        tokens = encoder.prompt_tokens(prompt)
        if tokens + 2 > encoder.max_length:
            raise ModelLoadError(f"prompt {name!r} of config_sentence_transformers.json is {tokens} tokens: with "
                                 f"the model's limit of {encoder.max_length} tokens it leaves none for a text")


_MATRYOSHKA_TAG = re.compile(r"^\s*-\s*loss:Matryoshka(2d)?Loss\s*$", re.MULTILINE)
_MATRYOSHKA_DIMS = re.compile(r'"matryoshka_dims"\s*:\s*\[([\d\s,]+)\]')


def folder_encoder(tokenizer: Any, folder: st_folder.STFolder, max_seq_length: int, spec: ModelSpec,
                   prompts: Mapping[str, str], exclude_prompt: bool = False) -> tuple[Tokenizer, TextEncoder]:
    """A sentence-transformers folder's text encoder, as every text task over one reads it: the fast tokenizer
    (lowercased first when the folder's Transformer says so), cut at the model's length, its prompts checked
    against the text limits at load."""
    fast = tokenizer.backend_tokenizer
    if folder.lowercase:
        lowercase_first(fast)
    encoder = TextEncoder(fast, max_seq_length, spec.truncate, exclude_prompt=exclude_prompt)
    check_prompts(prompts, encoder, spec.max_chars_per_text)
    return fast, encoder


def card_matryoshka(path: Path) -> list[int] | None:
    """The Matryoshka sizes a sentence-transformers model card declares (README.md: the ``loss:MatryoshkaLoss``
    tag in its front matter, and the loss's ``matryoshka_dims``), or None."""
    card = path / "README.md"
    if not card.is_file():
        return None
    text = card.read_text(encoding="utf-8", errors="replace")
    parts = text.split("---", 2) if text.startswith("---") else []
    if len(parts) < 3 or not _MATRYOSHKA_TAG.search(parts[1]):
        return None
    found = _MATRYOSHKA_DIMS.search(text)
    if found is None:
        return None
    return sorted({int(d) for d in found.group(1).split(",") if d.strip()})


def matryoshka(setting: Any, path: Path, dimension: int) -> list[int] | str | None:
    """The sizes ``dimensions`` may ask for besides the model's own: the setting (a list, or ``any``: 1 to the
    model's size), else the model card's; None: only the model's own size."""
    if setting is None:
        setting = card_matryoshka(path)
    if setting is None or setting == "any":
        return setting
    sizes = sorted({int(d) for d in setting})
    wrong = [d for d in sizes if not 0 < d <= dimension]
    if wrong:
        raise ModelLoadError(f"Matryoshka dimensions {wrong} are not between 1 and the model's {dimension}")
    return sizes or None


def allows_change(model: Any) -> bool:
    """The operator's consent to a model whose results are not comparable with the serving one's (the
    setting is named for the embedding task, where it first mattered; the other tasks' rules ignore it)."""
    return bool(model.allow_dimension_change)


class EmbeddingHandler(ModelTask):
    """Sentence embeddings from a Hugging Face encoder, pooled as the model's own configuration says."""

    task = "embedding"
    inputs = "texts"
    head = "hidden"
    pooling_modes: tuple[str, ...] = ("mean",)
    _head: torch.nn.Module | None = None

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        # The modules first: a folder of modules inferd cannot run (a Router's has no config.json) is named so.
        folder = st_folder.read_folder(spec.path, spec.allow_pickle)
        safetensors = check_weights(spec.path, spec.allow_pickle)
        config, tokenizer = load_tokenizer(spec.path)
        hidden = int(config.hidden_size)
        limit = length_limit(config, tokenizer, None)
        self.max_seq_length = min(spec.max_seq_length or folder.max_seq_length or limit, limit)
        self.pooling_modes = (spec.pooling,) if spec.pooling else folder.pooling or default_pooling(config)
        self.pooling = "+".join(self.pooling_modes)
        steps, self.dimension = head_steps(folder, self.pooling_modes, hidden, spec.normalize)
        self.normalize = bool(steps) and isinstance(steps[-1], st_modules.Normalize)
        self._head = PooledHead(steps).eval() if steps else None
        self.dense = [f"{s.path}: {s.in_features}->{s.out_features} {s.activation}" for s in steps
                      if isinstance(s, st_modules.Dense)]
        self.similarity_fn_name = folder.similarity_fn_name or "cosine"  # sentence-transformers' default
        self.pad_id = tokenizer.pad_token_id or 0
        self.prompts, self.default_prompt_name = folder.prompts, folder.default_prompt_name
        self.matryoshka = matryoshka(spec.settings.matryoshka_dimensions, spec.path, self.dimension)
        self.tokenizer, self.encoder = folder_encoder(tokenizer, folder, self.max_seq_length, spec, self.prompts,
                                                      exclude_prompt=not folder.include_prompt)
        self.max_token_vectors = spec.max_token_vectors
        return self.open_runner(spec, device, safetensors)  # last: see ModelTask

    def facts(self) -> TaskFacts:
        # Its token states are an output beside the dense vector (the gate measures the dense one: ``outputs``).
        return TaskFacts(dimension=self.dimension, pooling=self.pooling, normalize=self.normalize,
                         similarity_fn_name=self.similarity_fn_name, matryoshka_dimensions=self.matryoshka,
                         prompts=dict(self.prompts), default_prompt_name=self.default_prompt_name,
                         other={"dense": list(self.dense), "include_prompt": not self.encoder.exclude_prompt,
                                "outputs": [*self.outputs, "token_states"]})

    def incompatibility(self, serving: ModelDescription, allow_change: bool) -> str | None:
        return dimension_refusal(self.dimension, serving, allow_change)

    def preprocess(self, texts: list[str], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        return mark(options, self.encoder.encode(texts, options), (*self.outputs, "token_states"),
                    self.max_token_vectors)

    def forward(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        """Pooled vectors for a batch, the forward pass on ``runner`` (the accuracy gate passes torch's)."""
        return self.forward_with_states(runner, batch)[0]

    def forward_with_states(self, runner: Any, batch: list[Encoded]) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """The pooled vectors, and the hidden states with the attention mask they were computed under (left on
        the device: only the rows that asked for them are copied out)."""
        ids, mask, _ = self.collate(batch)
        pool_mask = mask
        if any(e.skip for e in batch):  # prompts left out of pooling (include_prompt: false)
            # A row's first ``skip`` attended tokens, wherever its padding is.
            skip = torch.tensor([e.skip for e in batch]).unsqueeze(1)
            pool_mask = mask * (mask.cumsum(dim=1) > skip)
        with torch.inference_mode():
            hidden = runner(ids, mask)
            keep, seen = pool_mask.to(hidden.device), mask.to(hidden.device)
            pooled = torch.cat([POOLERS[m](hidden, keep, seen) for m in self.pooling_modes], dim=-1).float()
            if self._head is not None:
                pooled = self._head.to(pooled.device)(pooled)
            return pooled.cpu().numpy(), hidden, mask

    def infer(self, batch: list[Encoded]) -> Any:
        if not asks_states(batch):
            return self.forward(self.runner, batch)
        pooled, hidden, mask = self.forward_with_states(self.runner, batch)
        return [TextOutputs(dense=pooled[row] if e.dense else None, token_states=states_of(hidden, mask, row))
                if isinstance(e, WithStates) else pooled[row] for row, e in enumerate(batch)]

    def postprocess(self, outputs: Any) -> list[Any]:
        return list(outputs)

    def warmup(self) -> None:
        sample = self.preprocess(["warm up", "a somewhat longer sentence to warm up the padded path"])
        self.infer(sample)
        self.infer(sample[:1])
