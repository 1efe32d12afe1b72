"""A MiniLM-sized cross-encoder made from the packaged all-MiniLM-L6-v2, with nothing downloaded (the rerank
phase's model, and the model tests' real-size cross-encoder; bench/minilm_cross_encoder.py writes one).

No cross-encoder ships in this project's packages, and nothing may be fetched at run time. The encoder's
weights are MiniLM's (the architecture of cross-encoder/ms-marco-MiniLM-L-6-v2: 6 layers, hidden 384, 12
heads); the one-label classification head is new, from a fixed seed. Its pairs/s is what a real MiniLM
cross-encoder costs and its outputs are a real-size model's numerics; its scores rank nothing meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from inferd.settings import ModelSettings, resolve_model_path

    source = resolve_model_path(ModelSettings())
    torch.manual_seed(seed)
    # The encoder's weights come from MiniLM; only the head (classifier.*, pooler.*) is new.
    model = BertForSequenceClassification.from_pretrained(source, num_labels=1, local_files_only=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    tokenizer.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Sigmoid", "version": "4.0.0"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
