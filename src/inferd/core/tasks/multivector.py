"""ColBERT: texts in, one normalised vector per kept token out (``TextOutputs.multivector``), for late interaction
(core/outputs.py maxsim; core/tasks/late_rerank.py serves it as a reranker).

The folder is PyLate's: a sentence-transformers Transformer, then one or more Dense projections of every token
state (``pylate.models.Dense.Dense``: a linear layer, bias as saved, an activation torch names), and in
``config_sentence_transformers.json`` the query and document markers and lengths. As PyLate's ``ColBERT.encode``
computes them:

- a marker token (``query_prefix`` "[Q] ", ``document_prefix`` "[D] ", each one token of the tokenizer) goes after
  the first token; a text is cut to its role's length (``query_length``, ``document_length``) marker included;
- a query with ``do_query_expansion`` is padded to ``query_length`` with the mask token, which the other tokens do
  not attend to (unless ``attend_to_expansion_tokens``), and keeps every position, expansion included;
- a document drops padding and the ``skiplist_words`` tokens (punctuation) from its vectors; special tokens stay;
- every kept vector is normalised.

A text is a query when its options say so (core/outputs.py ``is_query``), else a document. The projection runs
inside the forward pass (tasks/heads.py TokenHeads), so exported graphs hand over the projected vectors.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from inferd.core.description import Loaded, ModelDescription, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.outputs import TextOutputs, asked, is_query
from inferd.core.preprocess import Encoded, InputError, TextEncoder
from inferd.core.spec import ModelSpec
from inferd.core.tasks import st_files, st_modules
from inferd.core.tasks.base import TokenVectorTask, check_weights, dimension_refusal, length_limit, load_tokenizer
from inferd.core.tasks.embedding import PooledHead
from inferd.core.tasks.heads import TokenHeads
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions


@dataclass(frozen=True)
class ColbertFolder:
    """What a PyLate folder says (PyLate's defaults where it says nothing)."""

    dense: tuple[st_modules.Dense, ...]
    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    do_query_expansion: bool = True
    attend_to_expansion_tokens: bool = False
    skiplist_words: tuple[str, ...] = field(default_factory=lambda: tuple(string.punctuation))


def _pylate(module: st_files.Module) -> bool:
    return module.type.split(".")[0] == "pylate"


def is_colbert(path: Path) -> bool:
    """Whether the folder is PyLate's (a PyLate module in modules.json); an unreadable one is left to the load."""
    try:
        return any(_pylate(m) for m in st_files.modules(path) or [])
    except ModelLoadError:
        return False


def read_colbert(folder: Path, allow_pickle: bool = False) -> ColbertFolder:
    mods = st_files.modules(folder) or []
    kinds = [m.kind for m in mods]
    if not mods or kinds[0] != "Transformer" or mods[0].path or any(k != "Dense" for k in kinds[1:]) or len(mods) < 2:
        raise ModelLoadError(f"modules.json: the modules are {', '.join(kinds) or 'none'}; inferd runs a ColBERT "
                             "model as its Transformer (the folder itself) followed by Dense projections")
    dense = []
    for m in mods[1:]:
        cfg = st_files.json_file(folder, f"{m.path}/config.json")
        if isinstance(cfg, dict) and cfg.get("module_input_name") == "sentence_embedding":
            raise ModelLoadError(f"{m.describe()} acts on the pooled vector; a ColBERT projection acts on every token")
        # PyLate's Dense reads token_embeddings whatever its config says; read it as a plain Dense of them.
        plain = {k: v for k, v in (cfg or {}).items() if k not in ("module_input_name", "module_output_name")}
        dense.append(st_modules.dense_module(folder, m, allow_pickle, plain))
    cfg = st_files.json_file(folder, "config_sentence_transformers.json") or {}
    if not isinstance(cfg, dict):
        raise ModelLoadError("config_sentence_transformers.json must be a JSON object")
    defaults = ColbertFolder(tuple(dense))
    values: dict[str, Any] = {}
    for key, kind in (("query_prefix", str), ("document_prefix", str), ("query_length", int),
                      ("document_length", int), ("do_query_expansion", bool), ("attend_to_expansion_tokens", bool)):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 2)):
            raise ModelLoadError(f"config_sentence_transformers.json: {key} {value!r} is not a valid {kind.__name__}")
        values[key] = value
    words = cfg.get("skiplist_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ModelLoadError("config_sentence_transformers.json: skiplist_words must be a list of strings")
        values["skiplist_words"] = tuple(words)
    return ColbertFolder(**{**defaults.__dict__, **values})


@dataclass(frozen=True, slots=True)
class Marked(Encoded):
    """A tokenised text with its role: ``attended`` leading ids the model attends to (the rest are query
    expansion), and which positions' vectors it keeps."""

    attended: int = 0
    keep: tuple[int, ...] = ()


class ColbertHandler(TokenVectorTask):
    """Token vectors of a PyLate ColBERT folder, queries and documents each as PyLate encodes them."""

    task = "embedding"
    inputs = "texts"
    head = "tokens"
    outputs = ("multivector",)

    def load(self, spec: ModelSpec, device: torch.device) -> Loaded:
        self.colbert = folder = read_colbert(spec.path, spec.allow_pickle)
        safetensors = check_weights(spec.path, spec.allow_pickle)
        config, tokenizer = load_tokenizer(spec.path)
        hidden = int(config.hidden_size)
        size = hidden
        for d in folder.dense:
            if d.in_features != size:
                raise ModelLoadError(f"the Dense module {d.path} takes {d.in_features} values; it is given {size}")
            size = d.out_features
        self.dimension = size
        self.projection = PooledHead(list(folder.dense)).eval()
        self.max_token_vectors = spec.max_token_vectors
        limit = length_limit(config, tokenizer, None)
        self.max_seq_length = min(max(folder.query_length, folder.document_length), limit)
        self.prefix_ids = {}
        for role, prefix in (("query", folder.query_prefix), ("document", folder.document_prefix)):
            if prefix:
                pid = tokenizer.convert_tokens_to_ids(prefix)
                if pid is None or pid == tokenizer.unk_token_id:
                    raise ModelLoadError(f"the {role} marker {prefix!r} is not a token of the model's tokenizer")
                self.prefix_ids[role] = int(pid)
        expansion = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.eos_token_id
        if folder.do_query_expansion and expansion is None:
            raise ModelLoadError("query expansion pads queries with the mask token (or eos); the tokenizer has neither")
        self.expansion_id = int(expansion) if expansion is not None else 0
        # As PyLate: each skiplist word's id as the tokenizer converts it (an unknown word is the unknown token's).
        self.skiplist = {int(i) for i in tokenizer.convert_tokens_to_ids(list(folder.skiplist_words))
                         if i is not None}
        self.pad_id = tokenizer.pad_token_id or 0
        self.tokenizer = tokenizer.backend_tokenizer
        # One tokenizer each: an encoder sets its tokenizer's truncation.
        self.encoders = {
            role: TextEncoder(tok, min(length, limit) - (1 if role in self.prefix_ids else 0), spec.truncate)
            for role, length, tok in (("query", folder.query_length, Tokenizer.from_str(self.tokenizer.to_str())),
                                      ("document", folder.document_length, self.tokenizer))}
        return self.open_runner(spec, device, safetensors)

    def head_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return TokenHeads(model, None, self.projection, keep_hidden=False)

    def facts(self) -> TaskFacts:
        f = self.colbert
        return TaskFacts(similarity_fn_name="maxsim", other={
            "outputs": list(self.outputs), "multivector_dimension": self.dimension, "query_prefix": f.query_prefix,
            "document_prefix": f.document_prefix, "query_length": f.query_length,
            "document_length": f.document_length, "do_query_expansion": f.do_query_expansion})

    def incompatibility(self, serving: ModelDescription, allow_change: bool) -> str | None:
        # Its vectors are stored as an embedding's are, at its token vectors' size (its facts name no pooled one).
        return dimension_refusal(self.dimension, serving, allow_change)

    def _mark(self, enc: Encoded, role: str) -> Marked:
        ids = list(enc.ids)
        if role in self.prefix_ids:
            ids = ids[:1] + [self.prefix_ids[role]] + ids[1:]
        attended = len(ids)
        if role == "query" and self.colbert.do_query_expansion:
            ids += [self.expansion_id] * (self.colbert.query_length - len(ids))
            if self.colbert.attend_to_expansion_tokens:
                attended = len(ids)
            keep = tuple(range(len(ids)))
        elif role == "query":
            keep = tuple(range(len(ids)))
        else:
            keep = tuple(i for i, t in enumerate(ids) if t not in self.skiplist)
        return Marked(ids, enc.truncated, attended=attended, keep=keep)

    def text_window(self, options: TextOptions) -> int | None:
        # Its role's length, the marker taken out (the encoder's own bound): a piece sized by the model's window, the
        # longer role's, lost its last tokens to the cut, or (a query) most of them.
        return self.encoders["query" if is_query(options) else "document"].max_length

    def token_vectors(self, item: Encoded) -> int:
        return len(item.keep) if isinstance(item, Marked) else 0

    def encode_texts(self, texts: list[str], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        each = options.per_text(len(texts))
        roles = ["query" if is_query(o) else "document" for o in each]
        for i, chosen in enumerate(each):
            missing = [k for k in asked(chosen, self.outputs) if k not in self.outputs]
            if missing:
                raise InputError(i, f"asks for {', '.join(missing)}; this model gives multivector only",
                                 "unsupported_output")
        out: list[Encoded] = [Encoded([], False)] * len(texts)
        for role in ("query", "document"):
            idx = [i for i, r in enumerate(roles) if r == role]
            if idx:
                encoded = self.encoders[role].encode([texts[i] for i in idx], options.taking(idx))
                for i, enc in zip(idx, encoded, strict=True):
                    out[i] = self._mark(enc, role)
        return out

    def forward(self, runner: Any, batch: list[Encoded]) -> np.ndarray:
        """The projected, normalised token vectors ``[batch, length, dim]``, zeros where a text keeps none."""
        longest = max(e.tokens for e in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        keep = torch.zeros((len(batch), longest), dtype=torch.bool)
        for row, enc in enumerate(batch):
            assert isinstance(enc, Marked)
            ids[row, : enc.tokens] = torch.tensor(enc.ids)
            mask[row, : enc.attended] = 1
            keep[row, list(enc.keep)] = True
        with torch.inference_mode():
            out = torch.nn.functional.normalize(runner(ids, mask).float().cpu(), p=2, dim=-1)
        return (out * keep.unsqueeze(-1)).numpy()

    def forward_outputs(self, runner: Any, batch: list[Encoded]) -> dict[str, list[Any]]:
        vectors = self.forward(runner, batch)
        return {"multivector": [vectors[row, list(e.keep)] if isinstance(e, Marked) else vectors[row, :0]
                                for row, e in enumerate(batch)]}

    def postprocess(self, outputs: tuple[list[Encoded], np.ndarray]) -> list[TextOutputs]:
        batch, vectors = outputs
        return [TextOutputs(multivector=vectors[row, list(enc.keep)] if isinstance(enc, Marked) else None)
                for row, enc in enumerate(batch)]

    def infer(self, batch: list[Encoded]) -> tuple[list[Encoded], np.ndarray]:  # type: ignore[override]
        return batch, self.forward(self.runner, batch)

    def warmup(self) -> None:
        self.infer(self.preprocess(["warm up", "a somewhat longer sentence to warm up the padded path"]))
