"""The benchmark's outputs: machine description, bench/RESULTS.md, and the latency/throughput plot."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# name -> (results key, comparison, threshold) for the targets of issue 3.
TARGETS = {
    "inferd@32 / ceiling": ("inferd32_over_ceiling", ">=", 0.9),
    "inferd@32 / naive@32": ("inferd32_over_naive32", ">=", 1.8),
    "P99 / P50 at 50% load": ("p99_over_p50_at_50pct", "<=", 5.0),
}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    import torch

    from inferd import __version__

    info: dict[str, Any] = {
        "cpu": _cpu_model(), "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": _memory_gib(), "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "torch_threads_default": torch.get_num_threads(),
        "inferd": __version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if hasattr(os, "getloadavg"):
        info["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def target_rows(ratios: dict[str, float | None]) -> list[tuple[str, float | None, str, bool | None]]:
    rows = []
    for name, (key, op, threshold) in TARGETS.items():
        value = ratios.get(key)
        met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
        rows.append((name, value, f"{op} {threshold}", met))
    return rows


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


_COLUMNS = [("phase", None), ("texts/s", "texts_per_s"), ("P50 ms", "p50_ms"), ("P90 ms", "p90_ms"),
            ("P99 ms", "p99_ms"), ("mean batch", "mean_batch_size"), ("padding eff.", "padding_efficiency"),
            ("worker busy", "worker_busy"), ("errors", "errors"), ("client CPU", "client_cpu_share")]


def _table(phases: dict[str, dict[str, Any]], names: list[str], extra: list[tuple[str, str]]) -> list[str]:
    cols = _COLUMNS[:1] + extra + _COLUMNS[1:]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for name in names:
        p = phases[name]
        cells = [name]
        for _, key in cols[1:]:
            v = p.get(key)
            if key == "errors":
                v = sum(v.values()) if isinstance(v, dict) else v
            cells.append(_fmt(v, 3 if key in ("padding_efficiency", "worker_busy", "client_cpu_share") else 1))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _stage_table(phases: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    lines = ["| phase | batches | queue ms/text | tokenise ms/request | forward ms/batch | postprocess ms/batch |",
             "|---|---|---|---|---|---|"]
    for name in names:
        p = phases[name]
        lines.append(f"| {name} | {_fmt(p.get('batches'))} | {_fmt(p.get('queue_ms_mean'), 2)} | "
                     f"{_fmt(p.get('preprocess_ms_mean'), 2)} | {_fmt(p.get('inference_ms_per_batch'), 2)} | "
                     f"{_fmt(p.get('postprocess_ms_per_batch'), 2)} |")
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    m, phases, ratios = results["machine"], results["phases"], results["ratios"]
    by_kind = {k: [n for n, p in phases.items() if p.get("kind") == k and not p.get("error")]
               for k in ("ceiling", "closed", "open", "rerank")}
    out = ["# Benchmark results", "",
           f"Written by `inferd bench` on {results['date']} in {results['elapsed_s']:.0f} s.", "",
           "## Machine", "",
           f"- CPU: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['memory_gib']} GiB",
           f"- GPU: {m['gpu'] or 'none'}; device used: {results['settings']['device']}",
           f"- Python {m['python']}, torch {m['torch']}, inferd {m['inferd']}; {m['platform']}",
           f"- torch threads: {results['settings']['torch_threads'] or 'default'} "
           f"(in-process ceiling ran with {phases.get('ceiling', {}).get('torch_threads', '–')})",
           f"- load average at start / end: {m.get('load_avg_at_start')} / {m.get('load_avg_at_end')} "
           "(anything else running on the machine shows here)", "",
           "## Command", "", "```", results["command"], "```", "",
           f"Model: `{results['settings']['model']}`. Corpus: {results['corpus']['texts']} texts, tokens per text "
           f"min {results['corpus']['min']}, P50 {results['corpus']['p50']}, mean {results['corpus']['mean']}, "
           f"P90 {results['corpus']['p90']}, max {results['corpus']['max']} "
           f"(languages {results['corpus'].get('languages')}).", "",
           "## Targets (issue 3)", "", "| target | measured | wanted | met |", "|---|---|---|---|"]
    for name, value, wanted, met in target_rows(ratios):
        out.append(f"| {name} | {_fmt(value, 3)} | {wanted} | {'–' if met is None else ('yes' if met else 'NO')} |")
    out += ["", f"Peak (best closed-loop texts/s, one text per request): {_fmt(results.get('peak_texts_per_s'))}.",
            ""]
    if by_kind["ceiling"]:
        c = phases["ceiling"]
        out += ["## In-process ceiling (no HTTP; tokenise + forward, texts sorted by length)", "",
                "| batch size | texts/s | padding eff. |", "|---|---|---|"]
        out += [f"| {t['batch_size']} | {t['texts_per_s']:.1f} | {t['padding_efficiency']:.3f} |" for t in c["trials"]]
        out += ["", f"Best: batch {c['best_batch_size']}, **{c['texts_per_s']:.1f} texts/s** over {c['texts']} texts.",
                ""]
    if by_kind["closed"]:
        out += ["## Closed loop (each virtual user sends its next request when answered)", ""]
        out += _table(phases, by_kind["closed"], [("concurrency", "concurrency"),
                                                  ("texts/request", "texts_per_request")])
        out += [""]
    if by_kind["open"]:
        out += ["## Open loop (Poisson arrivals; latency from each request's scheduled send time)", ""]
        out += _table(phases, by_kind["open"], [("offered req/s", "offered_rate"), ("late sends", "late_sends")])
        out += [""]
    if by_kind["rerank"]:
        peak = results.get("peak_texts_per_s")
        out += ["## Rerank (a cross-encoder on /v1/rerank, 1 query + 32 documents per request)", "",
                "| phase | pairs/s | embedding peak texts/s | P50 ms | P99 ms |", "|---|---|---|---|---|"]
        out += [f"| {n} | {_fmt(phases[n]['pairs_per_s'])} | {_fmt(peak)} | {_fmt(phases[n].get('p50_ms'))} | "
                f"{_fmt(phases[n].get('p99_ms'))} |" for n in by_kind["rerank"]]
        out += ["", "Each document is one pair and one batch item; a pair carries the query's tokens as well.", ""]
        for n in by_kind["rerank"]:
            if phases[n].get("backends"):
                out += rerank_backends_table(phases[n]["backends"])
    inferd = [n for n in by_kind["closed"] + by_kind["open"] if phases[n].get("server") == "inferd"]
    if inferd:
        out += ["## Where inferd's time goes (means from its /metrics over each phase)", ""]
        out += _stage_table(phases, inferd) + [""]
    failed = [n for n, p in phases.items() if p.get("error")]
    if failed:
        out += ["## Phases that failed", ""]
        for n in failed:
            out += [f"- {n}:", "", "  ```", *("  " + line for line in phases[n]["error"].splitlines()), "  ```"]
        out += [""]
    out += ["## Notes", "",
            "- texts/s counts texts answered 200; a phase lasts until its last request is answered.",
            "- Padding efficiency = real tokens of the texts answered (counted by the client with the model's "
            "tokenizer) / padded tokens computed (inferd_batch_tokens). Worker busy = forward-pass seconds / "
            "phase seconds. Client CPU = the load generator's CPU seconds / phase seconds: on a small machine "
            "it is CPU the servers did not get.",
            "- The load generator (asyncio + httpx) runs in its own process, apart from the servers.",
            f"- Plot: `{results['files'].get('plot') or 'not written'}`.", ""]
    return "\n".join(out)


def plot_unavailable() -> str | None:
    """Why no plot can be drawn here (None: it can): matplotlib is a dev requirement (requirements-dev.in), which
    the runtime install (``make run``'s) leaves out. Asked before a run, so that minutes of measuring are never
    lost to the plot at the end."""
    try:
        import matplotlib  # noqa: F401  (optional: only the plots need it)
    except ImportError as exc:
        return f"matplotlib cannot be imported ({exc})"
    return None


def write_plot(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = results["phases"]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    groups = [("inferd closed loop", lambda p: p.get("server") == "inferd" and p.get("kind") == "closed"
               and p.get("texts_per_request") == 1, "tab:blue"),
              ("inferd open loop", lambda p: p.get("server") == "inferd" and p.get("kind") == "open", "tab:green"),
              ("inferd 16 texts/request", lambda p: p.get("server") == "inferd" and p.get("kind") == "closed"
               and p.get("texts_per_request", 1) > 1, "tab:purple"),
              ("naive baseline", lambda p: p.get("server") == "naive", "tab:red")]
    for label, pick, color in groups:
        names = [n for n, p in phases.items() if pick(p) and p.get("p50_ms") is not None]
        # Along the load axis (concurrency, or share of peak), so each line reads as the curve it is.
        names.sort(key=lambda n: (phases[n].get("concurrency") or 0, phases[n].get("load_share") or 0))
        if not names:
            continue
        x = [phases[n]["texts_per_s"] for n in names]
        ax.plot(x, [phases[n]["p50_ms"] for n in names], "o-", color=color, label=f"{label} P50")
        ax.plot(x, [phases[n]["p99_ms"] for n in names], "s--", color=color, alpha=0.7, label=f"{label} P99")
        for n, xi in zip(names, x, strict=True):
            ax.annotate(n, (xi, phases[n]["p99_ms"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ceiling = phases.get("ceiling", {}).get("texts_per_s")
    if ceiling:
        ax.axvline(ceiling, color="black", linestyle=":", label=f"in-process ceiling ({ceiling:.0f}/s)")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (texts/s)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title(f"inferd: latency against throughput — {results['machine']['cpu']}, "
                 f"{results['machine']['cores']} cores", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rerank_backends_table(summary: dict[str, Any]) -> list[str]:
    """The rerank phase's configurations side by side: pairs/s, P99, ratios within rounds, the targets."""
    def spread(d: dict[str, Any] | None) -> str:
        if not d or d.get("median") is None:
            return "–"
        return f"{d['median']:g} ({d['min']:g}–{d['max']:g})"

    others = sorted({o for row in summary["rows"].values() for o in row.get("versus", {})})
    out = [f"### Rerank by backend (ratios to {summary['baseline']} and to {', '.join(others) or 'no other server'}"
           ", round by round)", "",
           "| configuration | cold start s | pairs/s | P99 ms | ratio to baseline | " + " | ".join(
               f"× {o}" for o in others) + " |", "|---|---|---|---|---|" + "---|" * len(others)]
    for name, row in summary["rows"].items():
        if row.get("error"):
            out.append(f"| {name} | {row['error'].replace('|', '/')} |" + " |" * (3 + len(others)))
            continue
        versus = [", ".join(f"{r:g}" for r in row.get("versus", {}).get(o, [])) or "–" for o in others]
        out.append(f"| {name} | {row.get('cold_start_s', '–')} | {spread(row.get('pairs_per_s'))} | "
                   f"{spread(row.get('p99_ms'))} | {spread(row.get('ratio'))} | " + " | ".join(versus) + " |")
    lost = [f"{name} round {e['round'] + 1}: {e['error']}" for name, row in summary["rows"].items()
            for e in row.get("round_errors", [])]
    if lost:
        out += ["", "Rounds lost: " + "; ".join(lost)]
    if summary.get("targets"):
        out += ["", "| target | at least | ratios | median | met |", "|---|---|---|---|---|"]
        out += [f"| {t['configuration']} / {t['versus']} | {t['least']} | {', '.join(f'{r:g}' for r in t['ratios'])} "
                f"| {t['median'] if t['median'] is None else round(t['median'], 2)} | {'yes' if t['met'] else 'no'} |"
                for t in summary["targets"]]
    return [*out, ""]
