"""Which task a model folder was made for (``model.task: auto``) and the handler that serves it."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

from inferd.core.tasks.base import BUILTIN_TASKS, Handler, ModelLoadError
from inferd.core.tasks.classification import ClassificationHandler
from inferd.core.tasks.embedding import EmbeddingHandler
from inferd.core.tasks.late_rerank import LateInteractionRerankHandler
from inferd.core.tasks.llm_rerank import LLMRerankHandler, is_causal_lm
from inferd.core.tasks.m3 import M3Handler, has_heads
from inferd.core.tasks.multivector import ColbertHandler, is_colbert
from inferd.core.tasks.rerank import RerankHandler
from inferd.core.tasks.sparse import SparseHandler, is_splade
from inferd.core.tasks.st_folder import has_pooling


def detect_task(path: Path) -> str:
    """The task a model folder was made for, from its own files.

    A sentence-transformers embedding folder is an embedding model; ``*ForSequenceClassification`` is a
    cross-encoder (rerank) with one label and a classifier with more; a bare encoder (``*Model``) gives
    hidden states only an embedding task can use. Anything else, or a folder that is both, is ambiguous:
    ``model.task`` must say. A ``*ForCausalLM`` folder with no sentence-transformers files is an LLM reranker
    (Qwen3-Reranker); with them (Qwen3-Embedding's config names ``Qwen3ForCausalLM`` too) an embedding model.
    A folder with no readable config.json is left to the embedding handler, whose load names what is missing.
    """
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "embedding"
    archs = [str(a) for a in config.get("architectures") or []]
    if "HF_ColBERT" in archs:
        # Stanford's checkpoint keeps its projection inside model.safetensors and its markers in artifact.metadata.
        raise ModelLoadError(f"{path}: a Stanford ColBERT checkpoint (HF_ColBERT) is not served; save it in PyLate's "
                             "layout (pylate.models.ColBERT(path).save(...)), which inferd reads as a ColBERT model")
    seqcls = any(a.endswith("ForSequenceClassification") for a in archs)
    st = has_pooling(path)
    if seqcls and not st:
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
        return "rerank" if labels == 1 else "classification"
    if st and not seqcls:
        return "embedding"
    if not seqcls and all(a.endswith("Model") for a in archs):
        return "embedding"
    if not st and any(a.endswith("ForCausalLM") for a in archs):
        return "rerank"  # a causal LM is served as a yes/no reranker (llm_rerank.py); inferd generates nothing
    why = ("it holds both sentence-transformers embedding files and a sequence-classification head" if seqcls
           else f"its architecture ({', '.join(archs)}) is neither an encoder nor a sequence classifier")
    raise ModelLoadError(f"{path}: cannot tell which task to serve: {why}; set model.task to one of "
                         f"{', '.join(BUILTIN_TASKS)} (or package.module:Class)")


def _embedding(path: Path | None, pooling: str | None) -> Handler:
    """An embedding model of other outputs than a dense vector by its folder (SPLADE: its SpladePooling or
    ``pooling`` splade; ColBERT: a PyLate folder; bge-m3: its heads), else a dense one."""
    if path is not None:
        if pooling == "splade" or is_splade(path):
            return SparseHandler()
        if is_colbert(path):
            return ColbertHandler()
        if has_heads(path):
            return M3Handler()
    return EmbeddingHandler()


def _rerank(path: Path | None, pooling: str | None) -> Handler:
    """Token vectors (a PyLate folder first, as the embedding task picks it; bge-m3's heads): a late-interaction
    reranker (MaxSim) over the embedding handler; a causal LM: a yes/no reranker; else a cross-encoder."""
    if path is not None:
        if has_heads(path) or is_colbert(path):
            return LateInteractionRerankHandler(ColbertHandler() if is_colbert(path) else M3Handler())
        if is_causal_lm(path):
            return LLMRerankHandler()
    return RerankHandler()


def _classification(path: Path | None, pooling: str | None) -> Handler:
    return ClassificationHandler()


# The built-in tasks' handlers by task name (the names of kinds.py TASKS, which tests/unit/test_tasks.py holds this
# to): a new task is its handler module and a line here, beside its task object's line in TASKS.
HANDLERS: dict[str, Callable[[Path | None, str | None], Handler]] = {
    "embedding": _embedding, "rerank": _rerank, "classification": _classification}


def handler_for(task: str, path: Path | None = None, pooling: str | None = None) -> Handler:
    """A new, unloaded handler for ``task`` (a built-in name or ``package.module:Class``); ``path``, the model
    folder, and ``pooling`` choose among a built-in task's handlers (``HANDLERS``). A plug-in class must derive
    from ``Handler``: what it does not declare then has the contract's default, and the rest of the service reads
    its members without probing for them."""
    builtin = HANDLERS.get(task)
    if builtin is not None:
        return builtin(path, pooling)
    if ":" in task:
        module, _, name = task.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ModelLoadError(f"model.task {task!r} cannot be imported: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Handler)):
            raise ModelLoadError(f"model.task {task!r} is not a handler class: a handler derives from "
                                 "inferd.core.tasks.base.Handler (docs/handler.md)")
        try:
            return cls()
        except TypeError as exc:  # an abstract method left unimplemented, or an __init__ that needs arguments
            raise ModelLoadError(f"model.task {task!r} cannot be built: {exc}") from exc
    raise ModelLoadError(f"unknown model.task {task!r}; use auto, {', '.join(BUILTIN_TASKS)} or "
                         "package.module:Class")
