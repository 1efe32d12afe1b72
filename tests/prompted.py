"""Model folders with what the TEI and Cohere tests need beyond tinymodel.py's: sentence-transformers prompts,
a Matryoshka model card, a pooling that leaves the prompt out; and sentence-transformers as the reference."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

PROMPTS = {"query": "query: ", "document": "passage: ", "classification": "classify this: "}
CARD = """---
library_name: sentence-transformers
tags:
- sentence-transformers
- loss:MatryoshkaLoss
- loss:MultipleNegativesRankingLoss
---
# A model trained with MatryoshkaLoss

```json
{
    "loss": "MultipleNegativesRankingLoss",
    "matryoshka_dims": [
        32,
        16,
        8
    ],
    "matryoshka_weights": [1, 1, 1],
    "n_dims_per_step": -1
}
```
"""


def add_prompts(folder: Path, prompts: dict[str, str] | None = None, default: str | None = None) -> Path:
    """config_sentence_transformers.json with ``prompts`` and ``default_prompt_name``, as sentence-transformers
    saves it."""
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "__version__": {"sentence_transformers": "5.0.0"}, "prompts": PROMPTS if prompts is None else prompts,
        "default_prompt_name": default}))
    return folder


def add_matryoshka_card(folder: Path) -> Path:
    (folder / "README.md").write_text(CARD, encoding="utf-8")
    return folder


def exclude_prompt_from_pooling(folder: Path) -> Path:
    """The Pooling module's ``include_prompt: false`` (INSTRUCTOR-style models)."""
    cfg_path = folder / "1_Pooling" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["include_prompt"] = False
    cfg_path.write_text(json.dumps(cfg))
    return folder


def sentence_transformer(folder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(folder), device="cpu")
