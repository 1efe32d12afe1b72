"""What a server's event loop costs a forward pass that shares its cores, without any server: the in-process
loop (tokenise + forward + pool, sorted batches of 32, as the ``ceiling`` phase) alone, and beside another
process that burns a fixed share of one core in short bursts, as an event loop serving requests does.

    python bench/loop_interference.py [--backend openvino:bfloat16] [--duty 0,0.15,0.3] [--rounds 3]

The burner is a separate process (no GIL shared with the forward pass): every ``--period-ms`` it spins for
``duty`` of the period and sleeps the rest. If the forward pass lost only the CPU the burner takes, texts/s would
fall by about ``duty / cores``; a forward pass whose threads meet at barriers loses more, since a pre-empted
thread holds the others up. Rounds alternate the duties; ratios are to duty 0 in the same round.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path


def burn(duty: float, period: float, stop: mp.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < duty * period:
            pass
        time.sleep(max(0.0, period - (time.perf_counter() - start)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="openvino:bfloat16", help="BACKEND[:DTYPE] (default openvino:bfloat16)")
    p.add_argument("--duty", default="0,0.15,0.3", help="shares of one core the burner takes (0,0.15,0.3)")
    p.add_argument("--period-ms", type=float, default=2.0, help="the burner's period (2 ms: a request's loop work "
                                                               "comes in bursts of this order)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="each measurement (8 s)")
    p.add_argument("--cache", type=Path, default=Path("/tmp/inferd-interference-cache"))
    args = p.parse_args(argv)

    from inferd.core.loading import load_handler
    from inferd.core.spec import ModelSpec
    from inferd.corpus import texts
    from inferd.settings import ModelSettings, resolve_model_path

    backend, _, dtype = args.backend.partition(":")
    handler = load_handler(ModelSpec(resolve_model_path(ModelSettings()), "1", device="cpu", backend=backend,
                                     dtype=dtype or "float32", cache_dir=str(args.cache)))
    items = sorted(handler.preprocess(texts(512, seed=3)), key=lambda e: e.tokens)
    batches = [items[k:k + 32] for k in range(0, len(items), 32)]
    duties = [float(d) for d in args.duty.split(",")]
    rows: dict[float, list[float]] = {d: [] for d in duties}
    ratios: dict[float, list[float]] = {d: [] for d in duties}
    for r in range(args.rounds):
        measured: dict[float, float] = {}
        for duty in duties[r % len(duties):] + duties[:r % len(duties)]:
            stop = mp.Event()
            burner = mp.Process(target=burn, args=(duty, args.period_ms / 1000, stop), daemon=True) if duty else None
            if burner:
                burner.start()
            try:
                done, start, k = 0, time.perf_counter(), 0
                while time.perf_counter() - start < args.seconds:
                    handler.infer(batches[k % len(batches)])
                    done += len(batches[k % len(batches)])
                    k += 1
                measured[duty] = done / (time.perf_counter() - start)
            finally:
                stop.set()
                if burner:
                    burner.join(5)
            rows[duty].append(measured[duty])
            print(f"round {r + 1}: duty {duty:.2f}: {measured[duty]:.1f} texts/s", flush=True)
        for duty in duties:
            ratios[duty].append(measured[duty] / measured[duties[0]])
    print(f"\n{args.backend}, burner period {args.period_ms:g} ms, {args.rounds} rounds; ratio to duty "
          f"{duties[0]:g} in the same round; 'CPU only' = what taking duty/2 of 2 cores would cost")
    print("| burner duty (share of one core) | texts/s median (range) | ratio (range) | CPU only |")
    print("|---|---|---|---|")
    for duty in duties:
        v, q = rows[duty], ratios[duty]
        print(f"| {duty:.2f} | {statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f}) | "
              f"{statistics.median(q):.3f} ({min(q):.3f}–{max(q):.3f}) | {1 - duty / 2:.3f} |")
    handler.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
