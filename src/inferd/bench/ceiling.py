"""The in-process ceiling: inferd's own handler, tokenise + forward + postprocess, no HTTP, best batching.

The texts are tokenised in one call, sorted by length (so a batch pads almost nothing) and cut into batches
of each candidate size; the best texts/s is the ceiling a server on this machine can approach. Tokenising
is inside the timing: a server must do it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import resolve_device
from inferd.core.tasks.embedding import EmbeddingHandler


def load_handler(model_path: Path, device: str = "auto", torch_threads: int | None = None) -> EmbeddingHandler:
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    handler = EmbeddingHandler()
    handler.open(ModelSpec(path=model_path, name=model_path.name, version="bench", device=device),
                 resolve_device(device))
    handler.warmup()
    return handler


def token_counts(handler: EmbeddingHandler, texts: Sequence[str], chunk: int = 256) -> list[int]:
    """Tokens per text as the server counts them (special tokens in, truncated at the model's limit)."""
    out: list[int] = []
    for i in range(0, len(texts), chunk):
        out.extend(e.tokens for e in handler.preprocess(list(texts[i:i + chunk])))
    return out


def _one_pass(handler: EmbeddingHandler, texts: Sequence[str], batch_size: int) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    encoded = handler.preprocess(list(texts))
    order = sorted(range(len(encoded)), key=lambda i: encoded[i].tokens)
    padded = real = 0
    for start in range(0, len(order), batch_size):
        batch = [encoded[i] for i in order[start:start + batch_size]]
        handler.postprocess(handler.infer(batch))
        padded += max(e.tokens for e in batch) * len(batch)
        real += sum(e.tokens for e in batch)
    return time.perf_counter() - t0, real, padded


def measure(handler: EmbeddingHandler, texts: Sequence[str], batch_sizes: Sequence[int],
            progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """One timed pass per batch size over the same texts (after a short untimed warm-up of that size)."""
    import torch

    trials = []
    for bs in batch_sizes:
        _one_pass(handler, texts[: min(len(texts), 2 * bs)], bs)
        elapsed, real, padded = _one_pass(handler, texts, bs)
        trial = {"batch_size": bs, "texts": len(texts), "elapsed_s": round(elapsed, 3),
                 "texts_per_s": round(len(texts) / elapsed, 2), "padding_efficiency": round(real / padded, 3),
                 "mean_batch_size": round(len(texts) / -(-len(texts) // bs), 2)}
        trials.append(trial)
        progress(f"ceiling batch {bs:>3}: {trial['texts_per_s']:8.1f} texts/s "
                 f"(padding efficiency {trial['padding_efficiency']:.3f})")
    best = max(trials, key=lambda t: t["texts_per_s"])
    return {"kind": "ceiling", "server": "in-process", "texts_per_s": best["texts_per_s"],
            "best_batch_size": best["batch_size"], "padding_efficiency": best["padding_efficiency"],
            "texts": len(texts), "trials": trials, "torch_threads": torch.get_num_threads(),
            "device": str(handler.device), "p50_ms": None, "p90_ms": None, "p99_ms": None,
            "mean_batch_size": best["mean_batch_size"]}
