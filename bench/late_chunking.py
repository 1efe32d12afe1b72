"""What late chunking costs beside embedding the same pieces on their own (issue 41 item 2), in process, on the
model's own handler: no HTTP, no queue, so the figure is the work itself.

Both sides embed one document's pieces (core/chunking.py, the model's window less its special tokens): ``pieces``
runs every piece as its own input (mode pieces' forward passes), ``late`` runs windows of whole pieces asking for
their token states and pools each piece from its window's (core/late_chunking.py: the offsets tokenising, the
copy of the states to the host and the pooling are its extra work; its windows hold fewer special tokens).
Batches of ``--batch`` inputs, sorted by length as the scheduler groups them. Prints tokens/s of each and the ratio.
Pieces of ``--piece`` tokens (64 by default, several to a window: where late chunking is chosen; pieces as long as
the window make each window one piece, the same work on both sides).

    OMP_NUM_THREADS=2 .venv/bin/python bench/late_chunking.py --tokens 10000 --repeats 5   # ~1 min, two quiet cores
    .venv/bin/python bench/late_chunking.py --tokens 2000 --repeats 1                      # a check that it runs
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from inferd.core.chunking import split
from inferd.core.description import ModelDescription
from inferd.core.late_chunking import plan
from inferd.core.loading import load_handler
from inferd.core.spec import spec_from_settings
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions
from inferd.settings import ModelSettings, Settings

WORDS = ("river mountain city house the a of and in is was to for with that document contract clause party "
         "agreement term notice payment shall may within days written").split()


def document(tokens: int) -> str:
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "."
                 for _ in range(tokens // 12 + 1)]
    return " ".join(sentences)


def batched(handler: Any, inputs: list[Any], batch: int, options: InputOptions = PLAIN_INPUTS) -> list[Any]:
    encoded = handler.preprocess(inputs, options)
    order = sorted(range(len(encoded)), key=lambda i: encoded[i].tokens)
    out: list[Any] = [None] * len(encoded)
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        for i, result in zip(rows, handler.postprocess(handler.infer([encoded[i] for i in rows])), strict=True):
            out[i] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=10_000, help="the document's length, about")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--piece", type=int, default=64, help="tokens per piece (at most the window less 2)")
    args = parser.parse_args()
    handler = load_handler(spec_from_settings(Settings(model=ModelSettings(device="cpu", warmup=False))))
    window = handler.max_seq_length
    text = document(args.tokens)
    pieces = split(text, handler.tokenizer, max_tokens=min(args.piece, window - 2))
    tokens = sum(p.tokens for p in pieces)
    description = ModelDescription("m", "1", 1, "", "embedding", pooling=handler.pooling, normalize=handler.normalize)
    best = {"pieces": float("inf"), "late": float("inf")}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        batched(handler, [text[p.start:p.end] for p in pieces], args.batch)
        best["pieces"] = min(best["pieces"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        late = plan([text], [pieces], handler.tokenizer, "", window)
        asking = InputOptions(TextOptions(outputs=("token_states",)))
        states = batched(handler, [t for _, t in late.inputs], args.batch, asking)
        late.answers(states, description)
        best["late"] = min(best["late"], time.perf_counter() - t0)
    print(f"document: {tokens} tokens in {len(pieces)} pieces of at most {min(args.piece, window - 2)}, windows of "
          f"{window}; best of {args.repeats}")
    for name, seconds in best.items():
        print(f"{name:>6}: {seconds * 1e3:8.1f} ms  {tokens / seconds:9.0f} tokens/s")
    print(f"late / pieces throughput: {best['pieces'] / best['late']:.3f}")
    handler.close()


if __name__ == "__main__":
    main()
