"""The model architectures inferd serves, by ``config.json``'s ``model_type``, and the refusal of any other.

transformers' Auto classes load hundreds of architectures, but loading is not serving: a family is listed here
once a tiny random model of it, built in the tests, gives what sentence-transformers (or the model card's
formula) gives. Anything else is refused at load naming this list, rather than served on a guess (a model whose
forward pass needs inputs inferd does not feed, a pooling its outputs do not fit, an export never checked).

Every family listed runs on every backend: decoders (causal attention, last-token pooling, an LLM reranker's
yes/no head) export through the same exporter as encoders, without their key/value cache (backends/torch.py),
and are judged by the same accuracy gate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.core.errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    kind: str  # encoder | decoder


FAMILIES = (
    Family("BERT", ("bert",), "encoder"),
    Family("RoBERTa / XLM-RoBERTa", ("roberta", "xlm-roberta", "camembert"), "encoder"),
    Family("MPNet", ("mpnet",), "encoder"),
    Family("DistilBERT", ("distilbert",), "encoder"),
    Family("ModernBERT", ("modernbert",), "encoder"),
    Family("ELECTRA", ("electra",), "encoder"),
    Family("DeBERTa", ("deberta", "deberta-v2"), "encoder"),
    Family("Qwen2 / Qwen3", ("qwen2", "qwen3"), "decoder"),
    Family("Llama / Mistral", ("llama", "mistral"), "decoder"),
    Family("Gemma", ("gemma", "gemma2", "gemma3_text"), "decoder"),
)
BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported() -> str:
    return ", ".join(t for f in FAMILIES for t in f.model_types)


def family_of(path: Path) -> Family:
    """The family of the model in ``path`` (its config.json's ``model_type``); any other is refused, naming the
    supported list. Read from the file itself, before transformers: a remote-code model's type is unknown to it."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: config.json is not a JSON object")
    own_code = sorted(k for k in config.get("auto_map") or {} if k.startswith(("AutoModel", "AutoConfig")))
    if own_code:
        # transformers would load its own class of the same model_type instead: another model (jina-embeddings-v3's
        # LoRA adapters, gte-Qwen2's bidirectional attention), served silently.
        raise ModelLoadError(f"{path}: the model comes with its own code (config.json auto_map: "
                             f"{', '.join(own_code)}); inferd never runs a model folder's code (trust_remote_code)")
    kind = config.get("model_type")
    family = BY_TYPE.get(str(kind))
    if family is None:
        raise ModelLoadError(f"{path}: model_type {kind!r} is not a supported architecture; supported: "
                             f"{supported()} (docs/architectures.md)")
    return family


def default_pooling(config: Any) -> tuple[str, ...]:
    """The pooling of a folder that names none, as sentence-transformers chooses it: the last token of a causal LM
    (``*ForCausalLM`` first in ``architectures``, unless its config says ``is_causal: false``), else the mean."""
    archs = getattr(config, "architectures", None) or []
    causal = bool(archs) and str(archs[0]).endswith("ForCausalLM") and getattr(config, "is_causal", True)
    return ("lasttoken",) if causal else ("mean",)
