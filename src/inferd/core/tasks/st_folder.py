"""What a sentence-transformers folder says, in every format still in use, read once and checked.

``modules.json`` lists the modules ``SentenceTransformer.encode`` runs in order. inferd runs the chain
Transformer → Pooling → (Dense | Normalize)*: the Transformer is the folder's own Hugging Face model (its
``sentence_bert_config.json`` may cap the length), the Pooling one or more modes (concatenated, in the order
the folder gives), then each Dense (a linear layer and an activation torch names) and Normalize on the pooled
vector. A sentence-transformers ``SparseEncoder`` folder (SPLADE) is the chain Transformer (``fill-mask``, or
``MLMTransformer`` as before 5.4) → SpladePooling, read into ``Splade``. Any other module (a Router of asymmetric
models, static embeddings, a custom class that needs remote code) is refused by name: serving a chain with a step
left out would answer wrong vectors.

Formats: sentence-transformers before 5 wrote a Pooling config of booleans (``pooling_mode_mean_tokens: true``
…, several true = concatenated in a fixed order, none = mean); 5 and 6 write ``pooling_mode`` (a name or a
list of names) and ``embedding_dimension``; the module type names moved with each release
(``sentence_transformers.models.Pooling``, ``…sentence_transformer.modules.pooling.Pooling``), so a type is
known by its class name within the ``sentence_transformers`` package. ``config_sentence_transformers.json``
holds the prompts, the default prompt's name and the similarity function.

Every path a module names stays inside the folder (a module path of ``/etc`` or ``../x`` is refused as
written, without looking at what is there), and every error names files relative to the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from inferd.core.errors import ModelLoadError

# Pooling.POOLING_MODES, in the order the boolean format concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# Dense activations by torch class name: what ``Dense`` saves (``torch.nn.modules.activation.Tanh``) is
# imported by sentence-transformers; here only these are run, never an import a folder names.
ACTIVATIONS = {"Identity": torch.nn.Identity, "Tanh": torch.nn.Tanh, "Sigmoid": torch.nn.Sigmoid,
               "ReLU": torch.nn.ReLU, "GELU": torch.nn.GELU, "SiLU": torch.nn.SiLU, "ELU": torch.nn.ELU,
               "LeakyReLU": torch.nn.LeakyReLU, "Softplus": torch.nn.Softplus, "Softsign": torch.nn.Softsign,
               "Mish": torch.nn.Mish, "Hardtanh": torch.nn.Hardtanh, "Tanhshrink": torch.nn.Tanhshrink}
SIMILARITIES = {"cosine": "cosine", "dot": "dot", "dot_product": "dot", "euclidean": "euclidean",
                "manhattan": "manhattan"}
KNOWN_MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "MLMTransformer", "SpladePooling")
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
# The Transformer module's config, under each name sentence-transformers has read it by.
_TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                        "sentence_distilbert_config.json", "sentence_camembert_config.json",
                        "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                        "sentence_xlnet_config.json")


@dataclass(frozen=True)
class Module:
    """One entry of modules.json: its index, its path inside the folder and its class name."""

    idx: int
    path: str
    type: str

    @property
    def kind(self) -> str:
        return self.type.rpartition(".")[2]

    def describe(self) -> str:
        return f"module {self.idx} ({self.path or '.'}: {self.type})"


@dataclass(frozen=True)
class Dense:
    """A Dense module's layer: ``activation(x @ weight.T + bias)``, plus ``x`` (or ``x @ residual.T``) when it
    has a residual connection."""

    path: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str
    residual: bool = False
    residual_weight: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class Normalize:
    """L2 normalisation of the pooled vector."""

    path: str


@dataclass(frozen=True)
class Splade:
    """SpladePooling: ``log(1 + activation(logits))`` of the masked-LM logits (``log1p_relu`` takes log1p twice),
    pooled over the text's tokens by ``strategy`` (max or sum)."""

    strategy: str = "max"
    activation: str = "relu"


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


def _json(folder: Path, name: str) -> Any:
    """A JSON file of the folder, None when absent; an unreadable one is refused by its name in the folder."""
    path = folder / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else f"not valid JSON ({exc})"
        raise ModelLoadError(f"{name} in the model folder cannot be read: {reason}") from None


def inside_folder(path: str, what: str) -> str:
    """A path a folder's file names, refused unless it is relative and stays inside the folder (decided on
    the text alone, so the answer says nothing of what exists elsewhere)."""
    pure = PurePosixPath(path.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or (path[1:2] == ":"):
        raise ModelLoadError(f"{what}: path {path!r} leaves the model folder; the files a model folder names "
                             "must be inside it")
    return "" if str(pure) == "." else str(pure)


def modules(folder: Path) -> list[Module] | None:
    """modules.json's entries, in order; None when the folder has none."""
    raw = _json(folder, "modules.json")
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ModelLoadError("modules.json in the model folder must be a list of modules")
    out = []
    for i, m in enumerate(raw):
        kind, path = m.get("type"), m.get("path", "")
        if not isinstance(kind, str) or not isinstance(path, str):
            raise ModelLoadError(f"modules.json: module {i} needs a 'type' and a 'path' (strings)")
        idx = m.get("idx", i)
        out.append(Module(idx if isinstance(idx, int) else i, inside_folder(path, f"modules.json module {i}"), kind))
    return sorted(out, key=lambda m: m.idx)


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


def _pooling(cfg: Any, name: str) -> tuple[tuple[str, ...], int | None, bool]:
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{name} must be a JSON object")
    raw = cfg.get("pooling_mode")
    if raw is None:
        modes = tuple(mode for key, mode in _LEGACY_POOLING.items() if cfg.get(key))
        modes = modes or ("mean",)  # sentence-transformers' default when no boolean is set
    else:
        modes = (raw,) if isinstance(raw, str) else tuple(raw) if isinstance(raw, list) else ()
        if not modes or not all(isinstance(m, str) for m in modes):
            raise ModelLoadError(f"{name}: pooling_mode must be a mode's name or a list of them, not {raw!r}")
    wrong = [m for m in modes if m not in POOLING_MODES]
    if wrong:
        raise ModelLoadError(f"{name}: unsupported pooling mode {wrong[0]!r}; the modes are "
                             f"{', '.join(POOLING_MODES)}")
    dim = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0):
        raise ModelLoadError(f"{name}: embedding_dimension must be a positive integer, not {dim!r}")
    include = cfg.get("include_prompt", True)
    if not isinstance(include, bool):
        raise ModelLoadError(f"{name}: include_prompt must be true or false, not {include!r}")
    return modes, dim, include


def _activation(raw: Any, module: Module) -> str:
    """The activation's class name, when torch's own and in ACTIVATIONS; anything else is refused (a custom
    one needs remote code, which inferd does not run)."""
    if raw is None:
        return "Tanh"  # Dense's default
    name = raw.rpartition(".")[2] if isinstance(raw, str) else ""
    if not (isinstance(raw, str) and raw.startswith("torch.nn.") and name in ACTIVATIONS):
        raise ModelLoadError(f"{module.describe()}: activation function {raw!r} is not one inferd runs "
                             f"(torch.nn's {', '.join(ACTIVATIONS)})")
    return name


def json_file(folder: Path, name: str) -> Any:
    """A JSON file of the folder (None when absent), for readers of other layouts (core/tasks/multivector.py)."""
    return _json(folder, name)


def _dense_weights(folder: Path, module: Module, allow_pickle: bool) -> dict[str, torch.Tensor]:
    sub = folder / module.path
    where = f"{module.path}/" if module.path else ""
    if (sub / "model.safetensors").is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(sub / "model.safetensors"))
        except Exception as exc:  # the format's own errors (a truncated file, a bad header) name no path
            raise ModelLoadError(f"{where}model.safetensors cannot be read: {exc}") from None
    if (sub / "pytorch_model.bin").is_file():
        if not allow_pickle:
            raise ModelLoadError(f"{module.describe()} holds only pickle weights ({where}pytorch_model.bin); "
                                 "set model.allow_pickle: true to load them")
        try:
            # weights_only: tensors and plain containers only; nothing the file names is imported or run.
            state = torch.load(sub / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ModelLoadError(f"{where}pytorch_model.bin cannot be read as weights: "
                                 f"{type(exc).__name__}") from None
        if not isinstance(state, dict):
            raise ModelLoadError(f"{where}pytorch_model.bin does not hold a state dict")
        return state
    raise ModelLoadError(f"{module.describe()} has no weights ({where}model.safetensors)")


def _dense(folder: Path, module: Module, allow_pickle: bool) -> Dense:
    name = f"{module.path}/config.json"
    return dense_module(folder, module, allow_pickle, _json(folder, name) if module.path else None)


def dense_module(folder: Path, module: Module, allow_pickle: bool, cfg: Any) -> Dense:
    """A Dense module from its config (read by the caller) and its weights."""
    name = f"{module.path}/config.json"
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{module.describe()} has no config ({name})")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") not in ("sentence_embedding", None):
            raise ModelLoadError(f"{module.describe()} acts on {cfg[key]!r}; inferd runs Dense on the pooled "
                                 "vector (sentence_embedding) only")
    activation = _activation(cfg.get("activation_function"), module)
    state = _dense_weights(folder, module, allow_pickle)
    weight, bias = state.get("linear.weight"), state.get("linear.bias")
    shape = (cfg.get("out_features"), cfg.get("in_features"))
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
        raise ModelLoadError(f"{module.describe()}: its weights hold no linear.weight of shape "
                             f"{list(shape)} (out_features, in_features)")
    if cfg.get("bias", True) != (bias is not None):
        raise ModelLoadError(f"{module.describe()}: bias is {cfg.get('bias', True)} in its config, but its "
                             f"weights {'hold' if bias is not None else 'lack'} linear.bias")
    residual = bool(cfg.get("use_residual", False))
    projection = state.get("residual.weight") if residual and shape[0] != shape[1] else None
    if residual and shape[0] != shape[1] and projection is None:
        raise ModelLoadError(f"{module.describe()}: use_residual between sizes {shape[1]} and {shape[0]} "
                             "needs residual.weight, which its weights lack")
    return Dense(module.path, weight.float(), None if bias is None else bias.float(), activation, residual,
                 None if projection is None else projection.float())


def _normalize(folder: Path, module: Module) -> Normalize:
    cfg = _json(folder, f"{module.path}/config.json") if module.path else None
    if isinstance(cfg, dict):
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, "sentence_embedding") not in ("sentence_embedding", None):
                raise ModelLoadError(f"{module.describe()} normalises {cfg[key]!r}; inferd normalises the "
                                     "pooled vector (sentence_embedding) only")
    return Normalize(module.path)


def _length(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _transformer(folder: Path, module: Module, task: str = "feature-extraction") -> tuple[int | None, bool]:
    """The length cap and lowercasing the Transformer module's config sets, after checking it gives what
    pooling reads (``fill-mask``: the masked-LM logits SpladePooling reads)."""
    if module.path:
        raise ModelLoadError(f"{module.describe()}: the transformer must be the model folder itself "
                             "(path ''), as sentence-transformers 2 and later save it")
    cfg = next((c for c in (_json(folder, n) for n in _TRANSFORMER_CONFIGS) if c is not None), None)
    if cfg is None:
        return None, False
    if not isinstance(cfg, dict):
        raise ModelLoadError("sentence_bert_config.json must be a JSON object")
    default = "fill-mask" if module.kind == "MLMTransformer" else "feature-extraction"
    found = cfg.get("transformer_task", default)
    if found != task:
        raise ModelLoadError(f"{module.describe()}: transformer_task {found!r}; the modules after it read "
                             f"{task}'s output")
    output = "logits" if task == "fill-mask" else "last_hidden_state"
    modality = cfg.get("modality_config") or {}
    text = modality.get("text", {"method": "forward", "method_output_name": output}) \
        if isinstance(modality, dict) else modality
    if not isinstance(text, dict) or (text.get("method"), text.get("method_output_name")) != ("forward", output):
        raise ModelLoadError(f"{module.describe()}: its text output is {text!r}; inferd pools the forward pass's "
                             f"{output}")
    if cfg.get("module_output_name", "token_embeddings") != "token_embeddings":
        raise ModelLoadError(f"{module.describe()} outputs {cfg['module_output_name']!r}; inferd pools "
                             "token_embeddings")
    return _length(cfg.get("max_seq_length")), cfg.get("do_lower_case") is True


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
    max_len, lowercase = _transformer(folder, mods[0])
    name = f"{mods[1].path}/config.json" if mods[1].path else "the Pooling module's config.json"
    cfg = _json(folder, name) if mods[1].path else None
    if cfg is None:
        raise ModelLoadError(f"{mods[1].describe()} has no config ({name})")
    modes, dim, include = _pooling(cfg, name)
    after: list[Dense | Normalize] = [_dense(folder, m, allow_pickle) if m.kind == "Dense" else _normalize(folder, m)
                                      for m in mods[2:]]
    return {"pooling": modes, "embedding_dimension": dim, "include_prompt": include, "after": tuple(after),
            "max_seq_length": max_len, "lowercase": lowercase}


def _splade_chain(folder: Path, mods: list[Module]) -> dict[str, Any]:
    kinds = [m.kind for m in mods]
    if len(mods) != 2 or kinds[0] not in ("Transformer", "MLMTransformer") or kinds[1] != "SpladePooling":
        raise ModelLoadError(f"modules.json: the modules are {', '.join(kinds)}; inferd runs a SPLADE model as a "
                             "Transformer (fill-mask) followed by a SpladePooling, and nothing else")
    max_len, lowercase = _transformer(folder, mods[0], "fill-mask")
    name = f"{mods[1].path}/config.json"
    cfg = (_json(folder, name) if mods[1].path else None) or {}
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{name} must be a JSON object")
    strategy, activation = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES:
        raise ModelLoadError(f"{name}: pooling_strategy {strategy!r} is not one of {', '.join(SPLADE_STRATEGIES)}")
    if activation not in SPLADE_ACTIVATIONS:
        raise ModelLoadError(f"{name}: activation_function {activation!r} is not one of "
                             f"{', '.join(SPLADE_ACTIVATIONS)}")
    return {"splade": Splade(strategy, activation), "max_seq_length": max_len, "lowercase": lowercase}


def _st_config(folder: Path, kind_wanted: str = "SentenceTransformer") -> dict[str, Any]:
    """config_sentence_transformers.json: prompts, the default prompt's name, the similarity function."""
    name = "config_sentence_transformers.json"
    data = _json(folder, name)
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
        legacy = _json(folder, "sentence_bert_config.json")
        chain = {"max_seq_length": _length(legacy.get("max_seq_length")) if isinstance(legacy, dict) else None}
    return STFolder(**chain, **_st_config(folder, "SparseEncoder" if chain.get("splade") else "SentenceTransformer"))
