"""Forward-pass cost of the default model by batch shape, in-process: where the server's time goes.

Run: .venv/bin/python bench/forward_cost.py
Prints ms per batch, ms per text and thousand padded tokens per second for lengths 16/56/128 and batch sizes
1..32. On a CPU a forward streams every weight once whatever the batch, so small batches pay a large fixed
cost; that, with padding, is what the scheduler trades off.
"""

from __future__ import annotations

import time

from inferd.config import load_settings
from inferd.core.loading import load_handler
from inferd.core.preprocess import Encoded
from inferd.core.spec import spec_from_settings


def main() -> None:
    handler = load_handler(spec_from_settings(load_settings()))
    print("| tokens | batch | ms/batch | ms/text | k padded tokens/s |")
    print("|---|---|---|---|---|")
    for length in (16, 56, 128):
        for n in (1, 2, 4, 8, 16, 32):
            batch = [Encoded([101] + [2000] * (length - 2) + [102], False)] * n
            handler.infer(batch)
            reps = max(2, 40 // n)
            started = time.perf_counter()
            for _ in range(reps):
                handler.infer(batch)
            per = (time.perf_counter() - started) / reps
            print(f"| {length} | {n} | {per * 1e3:.1f} | {per * 1e3 / n:.2f} | {n * length / per / 1e3:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
