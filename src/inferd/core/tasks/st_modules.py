"""The modules of a sentence-transformers folder, each read from its own config (and weights) and checked.

- Transformer (or ``MLMTransformer``): the folder's own Hugging Face model, whose ``sentence_bert_config.json`` may
  cap the length and lowercase the texts; it must give what the module after it reads (the last hidden state to
  pool, or the masked-LM logits SpladePooling reads).
- Pooling: one or more modes, concatenated in the order the folder gives. sentence-transformers before 5 wrote a
  config of booleans (``pooling_mode_mean_tokens: true`` …, several true = concatenated in a fixed order, none =
  mean); 5 and 6 write ``pooling_mode`` (a name or a list of names) and ``embedding_dimension``. Both are read.
- Dense: a linear layer (its weights, safetensors or, when allowed, pickle) and an activation torch names, on the
  pooled vector; Normalize: L2 normalisation of the pooled vector.
- SpladePooling: ``log(1 + activation(logits))`` pooled over the text's tokens.

A module that acts on anything but what inferd runs it on is refused by name: serving it otherwise would answer
wrong vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferd.core.errors import ModelLoadError
from inferd.core.tasks.st_files import Module, json_file

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
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
# The Transformer module's config, under each name sentence-transformers has read it by.
_TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                        "sentence_distilbert_config.json", "sentence_camembert_config.json",
                        "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                        "sentence_xlnet_config.json")


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


def positive_length(value: Any) -> int | None:
    """A length a config gives, when it is a positive integer; anything else says nothing."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# -- Transformer ------------------------------------------------------------------------------------------


def read_transformer(folder: Path, module: Module, task: str = "feature-extraction") -> tuple[int | None, bool]:
    """The length cap and lowercasing the Transformer module's config sets, after checking it gives what
    pooling reads (``fill-mask``: the masked-LM logits SpladePooling reads)."""
    if module.path:
        raise ModelLoadError(f"{module.describe()}: the transformer must be the model folder itself "
                             "(path ''), as sentence-transformers 2 and later save it")
    cfg = next((c for c in (json_file(folder, n) for n in _TRANSFORMER_CONFIGS) if c is not None), None)
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
    return positive_length(cfg.get("max_seq_length")), cfg.get("do_lower_case") is True


# -- Pooling ----------------------------------------------------------------------------------------------


def read_pooling(folder: Path, module: Module) -> tuple[tuple[str, ...], int | None, bool]:
    """The Pooling module's modes, its dimension (None: the model's) and whether the prompt is pooled."""
    name = f"{module.path}/config.json" if module.path else "the Pooling module's config.json"
    cfg = json_file(folder, name) if module.path else None
    if cfg is None:
        raise ModelLoadError(f"{module.describe()} has no config ({name})")
    return _pooling(cfg, name)


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


# -- Dense and Normalize ----------------------------------------------------------------------------------


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


def read_dense(folder: Path, module: Module, allow_pickle: bool) -> Dense:
    """A Dense module from its own config.json and its weights."""
    name = f"{module.path}/config.json"
    return dense_module(folder, module, allow_pickle, json_file(folder, name) if module.path else None)


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


def read_normalize(folder: Path, module: Module) -> Normalize:
    cfg = json_file(folder, f"{module.path}/config.json") if module.path else None
    if isinstance(cfg, dict):
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, "sentence_embedding") not in ("sentence_embedding", None):
                raise ModelLoadError(f"{module.describe()} normalises {cfg[key]!r}; inferd normalises the "
                                     "pooled vector (sentence_embedding) only")
    return Normalize(module.path)


# -- SpladePooling ----------------------------------------------------------------------------------------


def read_splade(folder: Path, module: Module) -> Splade:
    """SpladePooling's strategy and activation (sentence-transformers' defaults, max and relu, when unset)."""
    name = f"{module.path}/config.json"
    cfg = (json_file(folder, name) if module.path else None) or {}
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{name} must be a JSON object")
    strategy, activation = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES:
        raise ModelLoadError(f"{name}: pooling_strategy {strategy!r} is not one of {', '.join(SPLADE_STRATEGIES)}")
    if activation not in SPLADE_ACTIVATIONS:
        raise ModelLoadError(f"{name}: activation_function {activation!r} is not one of "
                             f"{', '.join(SPLADE_ACTIVATIONS)}")
    return Splade(strategy, activation)
