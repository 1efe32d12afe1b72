"""Where the task contract used to live: the names other modules import, re-exported from core/tasks/."""

from __future__ import annotations

from inferd.core.tasks.base import (
    TOKENIZER_FILES,
    Handler,
    ModelLoadError,
    ModelSpec,
    check_weights,
    resolve_device,
)
from inferd.core.tasks.embedding import POOLERS, EmbeddingHandler, cls_pool, mean_pool, read_st_config

_TOKENIZER_FILES = TOKENIZER_FILES

__all__ = ["POOLERS", "EmbeddingHandler", "Handler", "ModelLoadError", "ModelSpec", "check_weights", "cls_pool",
           "mean_pool", "read_st_config", "resolve_device"]
