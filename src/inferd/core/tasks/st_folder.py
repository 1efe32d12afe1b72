"""What a sentence-transformers folder says, in every format still in use, read once and checked.

``modules.json`` lists the modules ``SentenceTransformer.encode`` runs in order. inferd runs the chain
Transformer → Pooling → (Dense | Normalize)*: the Transformer is the folder's own Hugging Face model, the Pooling
one or more modes, then each Dense and Normalize on the pooled vector. A sentence-transformers ``SparseEncoder``
folder (SPLADE) is the chain Transformer (``fill-mask``, or ``MLMTransformer`` as before 5.4) → SpladePooling. Any
other module (a Router of asymmetric models, static embeddings, a custom class that needs remote code) is refused
by name: serving a chain with a step left out would answer wrong vectors. Each module's own files are read by
core/tasks/st_modules.py, the folder's files by core/tasks/st_files.py; this module checks the chain they make and
reads what the folder says as a whole.

The module type names moved with each sentence-transformers release (``sentence_transformers.models.Pooling``,
``…sentence_transformer.modules.pooling.Pooling``), so a type is known by its class name within the
``sentence_transformers`` package. ``config_sentence_transformers.json`` holds the prompts, the default prompt's
name and the similarity function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.core.errors import ModelLoadError
from inferd.core.tasks.st_files import Module, json_file, modules
from inferd.core.tasks.st_modules import (
    Dense,
    Normalize,
    Splade,
    positive_length,
    read_dense,
    read_normalize,
    read_pooling,
    read_splade,
    read_transformer,
)

SIMILARITIES = {"cosine": "cosine", "dot": "dot", "dot_product": "dot", "euclidean": "euclidean",
                "manhattan": "manhattan"}
KNOWN_MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "MLMTransformer", "SpladePooling")


@dataclass(frozen=True)
class STFolder:
    """What the folder says; a folder without modules.json (a bare Hugging Face model) says nothing of
    pooling, and its model's settings decide."""

    pooling: tuple[str, ...] | None = None
    embedding_dimension: int | None = None
    include_prompt: bool = True
    after: tuple[Dense | Normalize, ...] = ()  # after pooling, in order
    max_seq_length: int | None = None
    lowercase: bool = False  # the Transformer's do_lower_case: texts are lowercased before tokenising
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    splade: Splade | None = None  # a SparseEncoder folder: no Pooling, SPLADE weights over the vocabulary

    @property
    def normalize(self) -> bool:
        return bool(self.after) and isinstance(self.after[-1], Normalize)


def has_pooling(folder: Path) -> bool:
    """Whether the folder is a sentence-transformers embedding folder (modules.json with a Pooling or a
    SpladePooling module); an unreadable modules.json is left for the load to name."""
    try:
        return any(m.kind in ("Pooling", "SpladePooling") for m in modules(folder) or [])
    except ModelLoadError:
        return False


def _known(module: Module) -> str | None:
    """The module's kind when inferd runs it: one of sentence-transformers' own classes by that name."""
    if module.type.split(".")[0] == "sentence_transformers" and module.kind in KNOWN_MODULES:
        return module.kind
    return None


def _chain(folder: Path, mods: list[Module], allow_pickle: bool) -> dict[str, Any]:
    """The modules as inferd runs them, or the first one it cannot, named."""
    for m in mods:
        if _known(m) is None:
            raise ModelLoadError(f"{m.describe()} is not a module inferd runs; it runs "
                                 f"sentence-transformers' {', '.join(KNOWN_MODULES)}, in that order")
    kinds = [m.kind for m in mods]
    if "SpladePooling" in kinds:
        return _splade_chain(folder, mods)
    if kinds[:2] != ["Transformer", "Pooling"] or "Transformer" in kinds[2:] or "Pooling" in kinds[2:]:
        raise ModelLoadError(f"modules.json: the modules are {', '.join(kinds)}; inferd runs a Transformer, "
                             "then a Pooling, then Dense and Normalize modules")
    max_len, lowercase = read_transformer(folder, mods[0])
    modes, dim, include = read_pooling(folder, mods[1])
    after: list[Dense | Normalize] = [read_dense(folder, m, allow_pickle) if m.kind == "Dense"
                                      else read_normalize(folder, m) for m in mods[2:]]
    return {"pooling": modes, "embedding_dimension": dim, "include_prompt": include, "after": tuple(after),
            "max_seq_length": max_len, "lowercase": lowercase}


def _splade_chain(folder: Path, mods: list[Module]) -> dict[str, Any]:
    kinds = [m.kind for m in mods]
    if len(mods) != 2 or kinds[0] not in ("Transformer", "MLMTransformer") or kinds[1] != "SpladePooling":
        raise ModelLoadError(f"modules.json: the modules are {', '.join(kinds)}; inferd runs a SPLADE model as a "
                             "Transformer (fill-mask) followed by a SpladePooling, and nothing else")
    max_len, lowercase = read_transformer(folder, mods[0], "fill-mask")
    return {"splade": read_splade(folder, mods[1]), "max_seq_length": max_len, "lowercase": lowercase}


def _st_config(folder: Path, kind_wanted: str = "SentenceTransformer") -> dict[str, Any]:
    """config_sentence_transformers.json: prompts, the default prompt's name, the similarity function."""
    name = "config_sentence_transformers.json"
    data = json_file(folder, name)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ModelLoadError(f"{name} must be a JSON object")
    kind = data.get("model_type", kind_wanted)
    if kind != kind_wanted:
        raise ModelLoadError(f"{name}: model_type {kind!r}; a folder of these modules is a {kind_wanted}")
    raw = data.get("prompts") or {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str | None) for k, v in raw.items()):
        raise ModelLoadError(f"{name}: 'prompts' must map names to prompt texts")
    prompts = {k: v or "" for k, v in raw.items()}
    default = data.get("default_prompt_name")
    if default is not None and (not isinstance(default, str) or default not in prompts):
        raise ModelLoadError(f"{name}: default_prompt_name {default!r} is not one of its prompts {sorted(prompts)}")
    similarity = data.get("similarity_fn_name")
    if similarity is not None and (not isinstance(similarity, str) or similarity not in SIMILARITIES):
        raise ModelLoadError(f"{name}: similarity_fn_name {similarity!r} is not one of "
                             f"{', '.join(sorted(set(SIMILARITIES.values())))}")
    return {"prompts": prompts, "default_prompt_name": default,
            "similarity_fn_name": None if similarity is None else SIMILARITIES[similarity]}


def read_folder(folder: Path, allow_pickle: bool = False) -> STFolder:
    """Everything the folder's sentence-transformers files say; refuses what inferd cannot run, by name."""
    mods = modules(folder)
    chain = _chain(folder, mods, allow_pickle) if mods else {}
    if not mods:
        legacy = json_file(folder, "sentence_bert_config.json")
        chain = {"max_seq_length": positive_length(legacy.get("max_seq_length")) if isinstance(legacy, dict) else None}
    return STFolder(**chain, **_st_config(folder, "SparseEncoder" if chain.get("splade") else "SentenceTransformer"))
