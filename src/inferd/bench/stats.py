"""Pure arithmetic for the benchmark: percentiles, latency summaries, Prometheus text, phase deltas.

No I/O here, so the maths is unit-tested on its own.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

# Prometheus series the benchmark reads from inferd's /metrics (summed over their labels).
SCRAPED = ("inferd_batch_size", "inferd_batch_tokens", "inferd_queue_duration_seconds",
           "inferd_preprocess_duration_seconds", "inferd_inference_duration_seconds",
           "inferd_postprocess_duration_seconds")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """P50/P90/P99/mean/max in milliseconds; None when no request succeeded."""
    if not latencies_s:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "mean_ms": None, "max_ms": None}
    ms = [x * 1000.0 for x in latencies_s]
    return {"p50_ms": round(percentile(ms, 50), 2), "p90_ms": round(percentile(ms, 90), 2),
            "p99_ms": round(percentile(ms, 99), 2), "mean_ms": round(sum(ms) / len(ms), 2),
            "max_ms": round(max(ms), 2)}


def describe(lengths: Sequence[int], langs: Sequence[str] = ()) -> dict[str, Any]:
    """Summary of a length distribution (tokens per text), for README and RESULTS."""
    out: dict[str, Any] = {"texts": len(lengths), "min": min(lengths), "max": max(lengths),
                           "mean": round(sum(lengths) / len(lengths), 1)}
    for q in (10, 50, 90, 99):
        out[f"p{q}"] = round(percentile(lengths, q), 1)
    if langs:
        out["languages"] = dict(sorted(Counter(langs).items()))
    return out


def parse_metrics(text: str, names: Sequence[str] = SCRAPED) -> dict[str, float]:
    """``<name>_sum`` and ``<name>_count`` for each histogram named, summed over all label sets."""
    wanted = {f"{n}{suffix}" for n in names for suffix in ("_sum", "_count")}
    out = dict.fromkeys(sorted(wanted), 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m and m.group(1) in wanted:
            out[m.group(1)] += float(m.group(3))
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def server_figures(before: Mapping[str, float], after: Mapping[str, float], real_tokens: int,
                   elapsed_s: float) -> dict[str, float | None]:
    """What inferd did during one phase, from two scrapes of /metrics.

    Padding efficiency is real tokens (counted by the client for the texts that were answered) over the
    padded tokens the server computed (longest × count per batch); the worker's busy share is its
    forward-pass time over the phase's wall time (1.0 = the model never waited for work).
    """
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    batches = d.get("inferd_batch_size_count", 0.0)
    padded = d.get("inferd_batch_tokens_sum", 0.0)
    infer_s = d.get("inferd_inference_duration_seconds_sum", 0.0)

    def mean_ms(name: str) -> float | None:
        r = _ratio(d.get(f"{name}_sum", 0.0), d.get(f"{name}_count", 0.0))
        return None if r is None else round(r * 1000.0, 3)

    eff = _ratio(real_tokens, padded)
    mean_batch = _ratio(d.get("inferd_batch_size_sum", 0.0), batches)
    busy = _ratio(infer_s, elapsed_s)
    return {
        "batches": int(batches),
        "mean_batch_size": None if mean_batch is None else round(mean_batch, 2),
        "padded_tokens": int(padded),
        "padding_efficiency": None if eff is None else round(eff, 3),
        "worker_busy": None if busy is None else round(busy, 3),
        "queue_ms_mean": mean_ms("inferd_queue_duration_seconds"),
        "preprocess_ms_mean": mean_ms("inferd_preprocess_duration_seconds"),
        "inference_ms_per_batch": mean_ms("inferd_inference_duration_seconds"),
        "postprocess_ms_per_batch": mean_ms("inferd_postprocess_duration_seconds"),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, or None when either side is missing (a phase skipped or failed)."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)
