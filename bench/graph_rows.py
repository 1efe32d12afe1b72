"""What a compiled graph's pass costs per token against the rows it multiplies: why small batches are dear.

    python bench/graph_rows.py [--runtime openvino:mixed] [--threads 1] [--length 48]

The model is loaded by the server's own loading code (the packaged MiniLM by default, its compiled graph from the
cache folder), on ``--threads`` intra-op threads as one of the prod overlay's instances runs it. Two tables, each
pass's CPU time read from the kernel (getrusage: this process, every thread) over repeated passes of one shape:

- batches of ``--length``-token texts, 1 to 32 of them: ms of CPU per text;
- shapes of the same rows (batch x length) split differently, and growing rows: µs of CPU per token.

A token-wise layer of an encoder multiplies a [rows, hidden] matrix (rows = batch x padded length): the CPU kernels
reach their rate only with enough rows, so a server batch of a few one-text requests costs more per token than a
corpus run's sorted batches of 32, whatever the batcher does with their lengths (bench/RESULTS.md, "2026-12-05,
seventh session").
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from pathlib import Path

import torch

from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.corpus import EN_WORDS
from inferd.settings import ModelSettings, resolve_model_path


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def text_of(tokens: int, seed: int) -> str:
    """A text the MiniLM tokenizer counts as ``tokens`` tokens with [CLS] and [SEP] (each corpus word is one)."""
    return " ".join(EN_WORDS[(seed * 7 + i) % len(EN_WORDS)] for i in range(tokens - 2))


def per_pass(handler: object, batch: int, length: int, budget_tokens: int = 60_000) -> float:
    """CPU ms of one pass (infer + postprocess) of ``batch`` texts of ``length`` tokens."""
    encoded = handler.preprocess([text_of(length, i) for i in range(batch)])  # type: ignore[attr-defined]
    assert all(e.tokens == length for e in encoded), "the texts did not tokenise to the asked length"
    for _ in range(3):
        handler.postprocess(handler.infer(encoded))  # type: ignore[attr-defined]
    passes = max(10, budget_tokens // (batch * length))
    start = cpu_s()
    for _ in range(passes):
        handler.postprocess(handler.infer(encoded))  # type: ignore[attr-defined]
    return (cpu_s() - start) * 1e3 / passes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model folder (default: the packaged MiniLM)")
    p.add_argument("--runtime", default="openvino:mixed", help="backend[:dtype]")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--cache", type=Path, help="the runtime's cache folder (default: a temporary one)")
    args = p.parse_args()
    model = args.model or resolve_model_path(ModelSettings())
    backend, _, dtype = args.runtime.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        handler = load_handler(ModelSpec(model, "bench", backend=backend, dtype=dtype or "float32", device="cpu",
                                         threads=args.threads, cache_dir=str(args.cache or tmp)))
        if not handler.runner.capabilities.torch_threads:
            torch.set_num_threads(1)  # as the server's workers do around a compiled graph (core/instances.py)
        else:
            torch.set_num_threads(args.threads)
        try:
            print(f"{args.runtime}, {args.threads} thread(s), {model}\n")
            print(f"| texts of {args.length} tokens | CPU ms / pass | CPU ms / text |\n|---|---|---|")
            for batch in (1, 2, 4, 8, 16, 32):
                ms = per_pass(handler, batch, args.length)
                print(f"| {batch} | {ms:.3f} | {ms / batch:.3f} |")
            print("\n| batch x length | rows | CPU µs / token |\n|---|---|---|")
            for batch, length in ((1, 32), (1, 128), (2, 64), (4, 32), (8, 16), (1, 256), (8, 32), (4, 64),
                                  (32, 32), (8, 128)):
                ms = per_pass(handler, batch, length)
                print(f"| {batch} x {length} | {batch * length} | {ms * 1e3 / (batch * length):.1f} |")
        finally:
            handler.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
