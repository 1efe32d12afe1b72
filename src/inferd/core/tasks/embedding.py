"""The embedding task: texts in, one pooled vector per text out (/v1/embeddings, /predict, TEI's /embed, Cohere's
/v1/embed and /v2/embed).

Beside pooling and normalisation, a sentence-transformers folder says two more things its clients rely on:
its **prompts** (``config_sentence_transformers.json``: ``prompts`` and ``default_prompt_name``; the routes
prepend the one a request names, see core/preprocess.py TextInput, and a pooling with ``include_prompt: false``
leaves the prompt's tokens out, as ``SentenceTransformer.encode(prompt_name=...)`` does), and whether its
vectors may be cut short (**Matryoshka**): ``model.matryoshka_dimensions`` (a list, or ``any``), else its
model card when it was trained with ``MatryoshkaLoss`` (the ``loss:MatryoshkaLoss`` tag and the loss's
``matryoshka_dims`` that sentence-transformers writes into README.md), else none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.core.errors import ModelLoadError
from inferd.core.preprocess import Encoded, TextEncoder
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import ModelTask, check_weights, dimension_refusal, length_limit, load_tokenizer

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


def read_st_config(path: Path) -> tuple[str | None, bool, int | None]:
    """What the model's sentence-transformers files say: pooling mode, normalisation, max length."""
    pooling, normalize, max_len = None, False, None
    modules = path / "modules.json"
    if modules.is_file():
        for module in json.loads(modules.read_text()):
            kind = module.get("type", "")
            if kind.endswith("Pooling"):
                cfg = json.loads((path / module["path"] / "config.json").read_text())
                if cfg.get("pooling_mode_cls_token"):
                    pooling = "cls"
                elif cfg.get("pooling_mode_mean_tokens"):
                    pooling = "mean"
                else:
                    raise ModelLoadError(f"{path}: unsupported pooling mode in {module['path']}/config.json")
            elif kind.endswith("Normalize"):
                normalize = True
    st = path / "sentence_bert_config.json"
    if st.is_file():
        max_len = json.loads(st.read_text()).get("max_seq_length")
    return pooling, normalize, max_len


def read_prompts(path: Path) -> tuple[dict[str, str], str | None, bool]:
    """The folder's prompts, its default prompt's name, and whether pooling keeps the prompt's tokens
    (sentence-transformers' ``Pooling.include_prompt``, true unless its config says otherwise)."""
    prompts: dict[str, str] = {}
    default = None
    cfg = path / "config_sentence_transformers.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        raw = data.get("prompts") or {}
        if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str | None)
                                                for k, v in raw.items()):
            raise ModelLoadError(f"{cfg}: 'prompts' must map names to prompt texts")
        prompts = {k: v or "" for k, v in raw.items()}
        default = data.get("default_prompt_name")
        if default is not None and default not in prompts:
            raise ModelLoadError(f"{cfg}: default_prompt_name {default!r} is not one of its prompts "
                                 f"{sorted(prompts)}")
    include = True
    modules = path / "modules.json"
    if modules.is_file():
        for module in json.loads(modules.read_text()):
            if module.get("type", "").endswith("Pooling"):
                pooling_cfg = path / module["path"] / "config.json"
                include = bool(json.loads(pooling_cfg.read_text()).get("include_prompt", True))
    return prompts, default, include


_MATRYOSHKA_TAG = re.compile(r"^\s*-\s*loss:Matryoshka(2d)?Loss\s*$", re.MULTILINE)
_MATRYOSHKA_DIMS = re.compile(r'"matryoshka_dims"\s*:\s*\[([\d\s,]+)\]')


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

    def load(self, spec: ModelSpec, device: torch.device) -> None:
        safetensors = check_weights(spec.path, spec.allow_pickle)
        st_pooling, st_normalize, st_max = read_st_config(spec.path)
        config, tokenizer = load_tokenizer(spec.path)
        self.name = spec.name
        self.version = spec.version
        self.dimension = int(config.hidden_size)
        limit = length_limit(config, tokenizer, None)
        self.max_seq_length = min(spec.max_seq_length or st_max or limit, limit)
        self.pooling = spec.pooling or st_pooling or "mean"
        self.normalize = spec.normalize if spec.normalize is not None else st_normalize
        self.pad_id = tokenizer.pad_token_id or 0
        self.prompts, self.default_prompt_name, include_prompt = read_prompts(spec.path)
        self.matryoshka = matryoshka(spec.settings.matryoshka_dimensions, spec.path, self.dimension)
        self.tokenizer = tokenizer.backend_tokenizer
        self.encoder = TextEncoder(self.tokenizer, self.max_seq_length, spec.truncate,
                                   exclude_prompt=not include_prompt)
        self._pool = POOLERS[self.pooling]
        self.open_runner(spec, device, safetensors)  # last: see ModelTask

    def describe(self) -> dict[str, Any]:
        return {"dimension": self.dimension, "pooling": self.pooling, "normalize": self.normalize,
                "matryoshka_dimensions": self.matryoshka, "prompts": dict(self.prompts),
                "default_prompt_name": self.default_prompt_name,
                "include_prompt": not self.encoder.exclude_prompt}

    def incompatibility(self, serving: Mapping[str, Any], allow_change: bool) -> str | None:
        return dimension_refusal(self.dimension, serving, allow_change)

    def preprocess(self, texts: list[str]) -> list[Encoded]:
        return self.encoder.encode(texts)

    def run(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        """Pooled vectors for a batch, the forward pass on ``runner`` (the accuracy gate passes torch's)."""
        ids, mask, _ = self.collate(batch)
        pool_mask = mask
        if any(e.skip for e in batch):  # prompts left out of pooling (include_prompt: false)
            pool_mask = mask.clone()
            for row, enc in enumerate(batch):
                pool_mask[row, : enc.skip] = 0
        with torch.inference_mode():
            hidden = runner(ids, mask)
            pooled = self._pool(hidden, pool_mask.to(hidden.device)).float()
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return pooled.cpu().numpy()

    def postprocess(self, outputs: np.ndarray) -> list[np.ndarray]:
        return list(outputs)

    def warmup(self) -> None:
        sample = self.preprocess(["warm up", "a somewhat longer sentence to warm up the padded path"])
        self.infer(sample)
        self.infer(sample[:1])
