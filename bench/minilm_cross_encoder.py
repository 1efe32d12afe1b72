"""Build a MiniLM-sized cross-encoder for the rerank phase of ``inferd bench``, with nothing downloaded.

No cross-encoder ships in this project's packages, and nothing may be fetched at run time. The rerank phase
measures cost, not ranking quality, so this script takes the packaged all-MiniLM-L6-v2 encoder (the same
architecture as cross-encoder/ms-marco-MiniLM-L-6-v2: 6 layers, hidden 384, 12 heads) and adds a one-label
classification head with a fixed seed. Its pairs/s is what a real MiniLM cross-encoder costs; its scores
mean nothing.

    python bench/minilm_cross_encoder.py /tmp/minilm-ce
    inferd bench --phases rerank --rerank-model /tmp/minilm-ce
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from inferd.config import ModelSettings, resolve_model_path

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder to write (created)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"{args.out} exists and is not empty", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    print(build(args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
