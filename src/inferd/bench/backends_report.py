"""The backends phase's figures summarised (median, range, ratios within each round, the issue's targets) and
reported (the markdown table, the plot)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 2), "min": round(min(vals), 2), "max": round(max(vals), 2)}


def summarise(rows: dict[str, dict[str, Any]], baseline: str | None, reference: str) -> dict[str, Any]:
    """Median/range per figure, and ratios to the baseline computed round by round."""
    base_rounds = {x["round"]: x for x in rows.get(baseline or "", {}).get("rounds", [])}
    for row in rows.values():
        rounds = row["rounds"]
        for key in ("in_process", "server", "warm_start_s"):
            row[key] = _spread([x.get(key) for x in rounds])
        for key in ("in_process", "server"):
            ratios = [x[key] / base_rounds[x["round"]][key] for x in rounds
                      if x.get(key) and base_rounds.get(x["round"], {}).get(key)]
            row[f"{key}_ratio"] = _spread(ratios)
        # The server's share of its own in-process ceiling, measured minutes apart within each round.
        row["of_ceiling"] = _spread([x["server"] / x["in_process"] for x in rounds
                                     if x.get("server") and x.get("in_process")])
    others = [name for name in rows if name.startswith("infinity") and rows[name]["rounds"]]
    for row in rows.values():  # server texts/s over each infinity engine's, round by round
        row["versus"] = {o: round_ratios(row["rounds"], rows[o]["rounds"]) for o in others}
    return {"baseline": baseline, "reference": reference, "rows": rows, "targets": targets(rows, baseline)}


def round_ratios(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str = "server") -> list[float]:
    """``mine[key] / theirs[key]`` for each round both measured: the same minutes of the machine's load."""
    by_round = {x["round"]: x.get(key) for x in theirs}
    return [round(x[key] / by_round[x["round"]], 3) for x in mine if x.get(key) and by_round.get(x["round"])]


# Issue 11's targets: (configuration, compared with, at least), server texts/s within each round. Static int8
# is judged with either float parts (float32, or bf16 where the CPU has it), whichever rows were measured.
TARGETS = (("openvino bf16", "infinity torch", 3.0), ("openvino bf16", "torch fp32", 1.8),
           ("openvino fp32 int8", "torch fp32", 2.5), ("openvino bf16 int8", "torch fp32", 2.5),
           ("openvino bf16", "infinity optimum", 1.2))


# On a CPU without native bf16 there is no bf16 row: the issue holds the int8 configurations to bf16's ratios.
STAND_INS = ("openvino fp32 int8", "openvino fp32 int8-weights")


def targets(rows: dict[str, dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    wanted: list[tuple[str, str, float, str]] = []
    for name, other, least in TARGETS:
        if name == "openvino bf16" and name not in rows:
            wanted += [(s, other, least, "for bf16: this CPU has none native") for s in STAND_INS]
        else:
            wanted.append((name, other, least, ""))
    out = []
    for name, other, least, note in wanted:
        if name not in rows or other not in rows or not rows[other]["rounds"]:
            continue
        row = rows[name]
        if not row["rounds"]:
            # Configured but never served (refused by the gate, failed to start): a target it did not meet.
            why = why_failed(row.get("error", "")).split(":")[0] if row.get("error") else "not measured"
            out.append({"config": name, "versus": other, "wanted": least, "rounds": [], "median": None,
                        "met": False, "accuracy": {}, "note": ", ".join(filter(None, [note, why]))})
            continue
        ratios = round_ratios(row["rounds"], rows[other]["rounds"])
        med = statistics.median(ratios) if ratios else None
        out.append({"config": name, "versus": other, "wanted": least, "rounds": ratios, "median": med,
                    "met": med is not None and med >= least, "accuracy": row.get("accuracy") or {}, "note": note})
    return out


def _cell(s: dict[str, float | None], digits: int = 1) -> str:
    if s.get("median") is None:
        return "–"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def why_failed(error: str) -> str:
    """The gate's verdict (or the last error line) out of a failed server's log tail."""
    lines = error.splitlines()
    line = next((ln for ln in lines if "refused by the accuracy gate" in ln),
                next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else ""))
    if "refused by the accuracy gate" in line:
        line = line[line.index("refused by the accuracy gate"):]
        return "**refused by the gate**" + line[len("refused by the accuracy gate"):].split('","')[0][:1000]
    return "failed: " + line.strip()[:300]


def render(section: dict[str, Any], rounds: int, duration: float) -> str:
    rows = section["rows"]
    out = [f"Accuracy against {section['reference']} (cosine min / mean: the worst over four batch shapes; "
           "overlap@10: of each text's ten nearest texts, the share also among the configuration's ten). "
           f"Throughput: median (range) over {rounds} rounds, configurations in rotating order; in-process = "
           "tokenise + forward, sorted batches of 32; server = closed loop, concurrency 32, one text per "
           f"request, {duration:g} s a round. × = ratio to {section['baseline']} within each round (median); "
           "of ceiling = server ÷ its own in-process texts/s, round by round.",
           "", "| configuration | in-process texts/s | × | server texts/s | × | of ceiling | cosine min / mean "
           "| overlap@10 | cold start s | warm start s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if "error" in row and not row.get("rounds"):
            out.append(f"| {name} | {why_failed(row['error'])} | | | | | | | | |")
            continue
        acc = row.get("accuracy") or {}
        cos = f"{acc['cosine_min']:.5f} / {acc['cosine_mean']:.5f}" if acc else "–"
        overlap = f"{acc['overlap_at_10']:.3f}" if acc else "–"
        out.append(f"| {name} | {_cell(row['in_process'])} | {_cell(row['in_process_ratio'], 2)} | "
                   f"{_cell(row['server'])} | {_cell(row['server_ratio'], 2)} | "
                   f"{_cell(row.get('of_ceiling') or {}, 2)} | {cos} | {overlap} | "
                   f"{row.get('cold_start_s', '–')} | {_cell(row['warm_start_s'])} |")
    if section.get("targets"):
        out += ["", "Targets (issue 11): server texts/s over the other's, round by round (same minutes of load); met = "
                "the median reaches the wanted ratio. Accuracy as above.", "",
                "| configuration | over | wanted | median | per round | cosine mean | overlap@10 | met |",
                "|---|---|---|---|---|---|---|---|"]
        for t in section["targets"]:
            acc = t["accuracy"]
            med = "–" if t["median"] is None else f"{t['median']:.2f}"
            note = f" ({t['note']})" if t.get("note") else ""
            out.append(f"| {t['config']}{note} | {t['versus']} | ≥ {t['wanted']:g} | {med} | "
                       f"{', '.join(f'{x:.2f}' for x in t['rounds']) or '–'} | {acc.get('cosine_mean', '–')} | "
                       f"{acc.get('overlap_at_10', '–')} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(out) + "\n"


def write_plot(section: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(n, r) for n, r in section["rows"].items() if (r.get("server") or {}).get("median")]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    names = [n for n, _ in rows]
    med = [r["server"]["median"] for _, r in rows]
    err = [[m - r["server"]["min"] for m, (_, r) in zip(med, rows, strict=True)],
           [r["server"]["max"] - m for m, (_, r) in zip(med, rows, strict=True)]]
    ax.barh(names, med, xerr=err, color=["#888" if n.startswith("infinity") else "#3a7" for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("texts/s, closed loop, concurrency 32, one text per request (median, range)")
    ax.set_title("Backends side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def backends_markdown(results: dict[str, Any]) -> str:
    section = results.get("backends")
    if not section:
        return ""
    s = results["settings"]
    return ("\n## Backends side by side (`--phases backends`)\n\n"
            + render(section, s.get("backend_rounds", 0), s["duration_s"]) + "\n")
