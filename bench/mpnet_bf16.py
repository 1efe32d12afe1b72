"""all-mpnet-base-v2 on OpenVINO bf16 with the half bound loosened to 0.99: the gate's own figures, then retrieval
agreement with torch fp32 on 512 corpus texts (cosine, overlap of each text's ten nearest, the same nearest).

The figures behind docs/backends.md, "A base-size model on bf16" (bench/RESULTS.md). Needs a CPU with native bf16
(elsewhere OpenVINO runs float32 and the figures are 1.0). ``python bench/mpnet_bf16.py`` (minutes: export plus gate).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import numpy as np

from inferd.bench.mpnet import mpnet_folder
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.corpus import texts as corpus_texts

K = 10


def vectors(handler, texts: list[str]) -> np.ndarray:
    out = [np.asarray(handler.postprocess(handler.infer(handler.preprocess(texts[i:i + 32]))))
           for i in range(0, len(texts), 32)]
    v = np.concatenate(out)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def nearest(v: np.ndarray) -> np.ndarray:
    sim = v @ v.T
    np.fill_diagonal(sim, -2.0)  # a text is not its own neighbour
    return np.argsort(-sim, axis=1)[:, :K]


def main() -> None:
    folder = mpnet_folder()
    started = time.time()
    with tempfile.TemporaryDirectory() as cache:
        bf16 = load_handler(ModelSpec(folder, "1", name="mpnet", device="cpu", warmup=False, backend="openvino",
                                      dtype="bfloat16", cache_dir=cache, gate={"half_cosine_min": 0.99}))
        print(f"cold start {time.time() - started:.1f} s", file=sys.stderr)
        print(json.dumps(bf16.loaded.backend_info["gate"], indent=1, default=str))
        fp32 = load_handler(ModelSpec(folder, "1", name="mpnet", device="cpu", warmup=False))
        texts = corpus_texts(512, seed=99)
        a, b = vectors(fp32, texts), vectors(bf16, texts)
    cos = (a * b).sum(axis=1)
    na, nb = nearest(a), nearest(b)
    overlap = np.mean([len(set(x) & set(y)) / K for x, y in zip(na, nb, strict=True)])
    print(json.dumps({"corpus_texts": len(texts), "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()),
                      "overlap_at_10": float(overlap), "same_nearest": float(np.mean(na[:, 0] == nb[:, 0]))}))


if __name__ == "__main__":
    main()
