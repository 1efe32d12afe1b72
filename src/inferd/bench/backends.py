"""The backends phase of ``inferd bench``: every configured runtime on the same corpus, side by side.

For each configuration (``backend[:dtype][:quantize]``, e.g. ``openvino:bfloat16`` or ``onnx:int8``; ``torch:padded``
is torch with the padded forward pass instead of the default, unpadded on a CPU):
  cold start  ``inferd serve`` with an empty export cache: export, quantisation and the accuracy gate included;
  accuracy    its vectors against sentence-transformers' on the corpus, worst over four batch shapes (one
              text, sorted 32, shuffled 32, padded to the limit), and the top-10 neighbour overlap;
  in-process  tokenise + forward, texts sorted by length, batches of 32 (the ceiling), passes over the corpus
              for at least ``--duration`` seconds, the server's own window;
  server      a warm start (timed), then closed loop, concurrency 32, one text per request.
Each round measures every configuration in process, then every server, the configurations in rotating order, so
a drifting machine load falls on all of them alike and a server is compared with its ceiling of the same minutes;
the table gives each figure's median and range, the ratio to torch fp32 taken within each round, and each
server's share of its own in-process ceiling, round by round. Infinity (``--infinity``, a separate installation) runs
as a separate server, with each of its engines, under the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.procs import ServerFailed, ServerProc, start_inferd
from inferd.core.agreement import cosine_rows, overlap_at_k
from inferd.core.backends import gate
from inferd.settings import BACKENDS, DTYPES, QUANTIZE

DEFAULT_CONFIGS = ("torch,torch:padded,torch:bfloat16,onnx,onnx:int8,openvino,openvino:bfloat16,"
                   "openvino:int8-weights,openvino:int8")
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "auto"}


@dataclass(frozen=True)
class Config:
    backend: str
    dtype: str = "float32"
    quantize: str = "none"
    padded: bool = False  # torch only: the padded forward pass (model.unpadded: false) instead of auto

    @property
    def name(self) -> str:
        return " ".join([self.backend, _SHORT[self.dtype], *([self.quantize] if self.quantize != "none" else []),
                         *(["padded"] if self.padded else [])])

    def env(self, cache: Path) -> dict[str, str]:
        env = {"INFERD__MODEL__BACKEND": self.backend, "INFERD__MODEL__DTYPE": self.dtype,
               "INFERD__MODEL__QUANTIZE": self.quantize, "INFERD__MODEL__CACHE_DIR": str(cache)}
        if self.padded:
            env["INFERD__MODEL__UNPADDED"] = "false"
        return env


def parse_configs(spec: str) -> list[Config]:
    """``torch,openvino:bfloat16,onnx:int8`` → configurations; a dtype and a quantisation in any order."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        backend, *rest = item.split(":")
        if backend not in BACKENDS:
            raise argparse.ArgumentTypeError(f"{item!r}: backend must be one of {', '.join(BACKENDS)}")
        kw: dict[str, Any] = {}
        for part in rest:
            if part == "padded" and backend == "torch" and "padded" not in kw:
                kw["padded"] = True
                continue
            key = "dtype" if part in DTYPES else "quantize" if part in QUANTIZE else None
            if key is None or key in kw:
                raise argparse.ArgumentTypeError(
                    f"{item!r}: after the backend give at most one dtype ({', '.join(DTYPES)}) and one "
                    f"quantisation ({', '.join(QUANTIZE)}); torch also takes 'padded'")
            kw[key] = part
        out.append(Config(backend, **kw))
    if not out:
        raise argparse.ArgumentTypeError("no backend configuration given")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", type=parse_configs, default=parse_configs(DEFAULT_CONFIGS),
                   help=f"backends phase: configurations to compare (default {DEFAULT_CONFIGS})")
    p.add_argument("--backend-rounds", type=int, default=3, help="backends phase: rounds (default 3)")
    p.add_argument("--backend-texts", type=int, default=512,
                   help="backends phase: corpus texts for accuracy and the in-process figure (default 512)")
    p.add_argument("--infinity", type=Path, metavar="PATH",
                   help="backends phase: infinity_emb executable (a separate venv) to run beside inferd")
    p.add_argument("--infinity-engines", default="torch,optimum",
                   help="backends phase: infinity engines to run (default torch,optimum)")
    p.add_argument("--infinity-onnx-model", type=Path, metavar="DIR",
                   help="backends phase: the folder infinity's optimum engine loads (default --model): it needs "
                        "an ONNX export beside the tokenizer whose output is last_hidden_state ("
                        "optimum-cli export onnx --library-name transformers --task feature-extraction)")


# -- accuracy ---------------------------------------------------------------------------------------------


def reference_vectors(model: Path, texts: Sequence[str]) -> tuple[np.ndarray, str]:
    """sentence-transformers' vectors (what users compare with); inferd's torch fp32 if it is missing."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return np.empty(0), "inferd torch fp32 (sentence-transformers is not installed)"
    st = SentenceTransformer(str(model), device="cpu")
    vectors = st.encode(list(texts), batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    del st
    return np.asarray(vectors, dtype=np.float64), "sentence-transformers"


def accuracy(handler: Any, texts: Sequence[str], reference: np.ndarray) -> dict[str, float]:
    """Cosine min/mean and top-10 overlap to the reference, each the worst over the gate's batch shapes."""
    items = handler.preprocess(list(texts))
    filler = gate.at_limit(handler, texts)
    mins, means, overlaps = [], [], []
    for plan in gate.plans(0).values():
        got = gate.outputs(handler, handler.runner, items, plan(items), filler)
        cos = cosine_rows(reference, got)
        mins.append(float(cos.min()))
        means.append(float(cos.mean()))
        overlaps.append(overlap_at_k(reference, got))
    return {"cosine_min": round(min(mins), 6), "cosine_mean": round(min(means), 6),
            "overlap_at_10": round(min(overlaps), 4)}


def in_process(handler: Any, texts: Sequence[str], batch_size: int = 32, min_seconds: float = 0.0) -> float:
    """texts/s: tokenise, sort by length, forward in batches, pool (the ceiling's method); whole passes over
    ``texts`` until ``min_seconds`` have gone by (one pass at least)."""
    t0 = time.perf_counter()
    done = 0
    while True:
        encoded = handler.preprocess(list(texts))
        order = sorted(range(len(encoded)), key=lambda i: encoded[i].tokens)
        for k in range(0, len(order), batch_size):
            handler.postprocess(handler.infer([encoded[i] for i in order[k:k + batch_size]]))
        done += len(texts)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return done / elapsed


# -- infinity ---------------------------------------------------------------------------------------------


def st_pooling(model: Path) -> str:
    """``mean`` or ``cls``: the sentence-transformers folder's pooling, as infinity's ``--pooling-method`` names it
    (``auto`` where the folder does not say). Its optimum engine pools the CLS token unless told: the graph folder
    it loads has no sentence-transformers files (all-MiniLM-L6-v2, a mean-pooling model, answered cosine 0.28 to
    sentence-transformers without it)."""
    try:
        modules = json.loads((model / "modules.json").read_text())
        pooling = next(m for m in modules if m.get("type", "").endswith("Pooling"))
        config = json.loads((model / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError):
        return "auto"
    if config.get("pooling_mode_mean_tokens") or config.get("pooling_mode") == "mean":
        return "mean"
    return "cls" if config.get("pooling_mode_cls_token") or config.get("pooling_mode") == "cls" else "auto"


def start_infinity(exe: Path, engine: str, model: Path, logs: Path, threads: int | None,
                   timeout: float = 600.0, pooling: str = "auto") -> ServerProc:
    """``infinity_emb v2`` on a free port, one model, batches of up to 32; returns once /health answers."""
    from inferd.bench.procs import _base_env, _spawn, free_port

    port = free_port()
    env = _base_env(threads)
    env["INFINITY_ANONYMOUS_USAGE_STATS"] = "0"  # no telemetry (the machine has no way out anyway)
    env["HF_HOME"] = str(logs / "infinity-hf")  # its optimum engine writes optimised graphs there
    # Its optimum engine lists a local folder's files by their full path and then asks optimum for that path
    # inside the folder, which fails ("only found: model.onnx"): started inside the folder as ".", the paths
    # it lists are relative and the lookup works.
    cwd = model.resolve() if engine == "optimum" else None
    cmd = [str(exe), "v2", "--model-id", "." if cwd else str(model), "--served-model-name", "model",
           "--engine", engine, "--device", "cpu", "--batch-size", "32", "--host", "127.0.0.1", "--port", str(port),
           "--url-prefix", "", "--no-model-warmup", "--log-level", "warning", "--pooling-method", pooling]
    server = _spawn(f"infinity-{engine}", cmd, env, port, logs, cwd=cwd)
    server.wait_ready("/health", timeout)
    return server


def infinity_vectors(server: ServerProc, texts: Sequence[str], per_request: int = 16) -> np.ndarray:
    import httpx

    out: list[list[float]] = []
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for k in range(0, len(texts), per_request):
            r = c.post("/embeddings", json={"model": "model", "input": list(texts[k:k + per_request])})
            r.raise_for_status()
            out.extend(d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"]))
    return np.asarray(out, dtype=np.float64)


# -- the phase --------------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 2), "min": round(min(vals), 2), "max": round(max(vals), 2)}


def _rotated(items: list[Any], r: int) -> list[Any]:
    return items[r % len(items):] + items[:r % len(items)] if items else items


def run_phase(args: argparse.Namespace, model: Path, texts: Sequence[str], source: TextSource,
              say: Callable[[str], None], logs: Path) -> dict[str, Any]:
    """Everything in the module docstring; returns the per-configuration figures and the per-round raw ones."""
    from inferd.config import load_settings
    from inferd.core.loading import load_handler
    from inferd.core.spec import spec_from_settings

    configs: list[Config] = args.backend
    corpus = list(texts[: args.backend_texts])
    logs.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="inferd-bench-cache-", dir=logs))
    threads = args.torch_threads
    rows: dict[str, dict[str, Any]] = {c.name: {"config": c.__dict__, "rounds": []} for c in configs}
    say(f"backends: reference vectors for {len(corpus)} texts")
    reference, ref_name = reference_vectors(model, corpus)
    # A model the gate refuses makes the server exit at once (rather than serve "failed" until the timeout).
    base = {"INFERD__MODEL__DEVICE": "cpu", "INFERD__MODEL__EXIT_ON_LOAD_FAILURE": "true", **dict(args.server_env)}

    for c in configs:  # cold starts: each export, quantisation and gate, timed as a server start
        say(f"backends: {c.name}: cold start (empty cache: export + gate)")
        t0 = time.monotonic()
        try:
            server = start_inferd(logs, model, threads, {**base, **c.env(cache)}, timeout=1800)
        except ServerFailed as exc:
            rows[c.name]["error"] = str(exc)[-3000:]
            say(f"backends: {c.name}: FAILED to start: {why_failed(rows[c.name]['error'])}")
            continue
        rows[c.name]["cold_start_s"] = round(time.monotonic() - t0, 2)
        server.stop()

    live = [c for c in configs if "error" not in rows[c.name]]
    handlers: dict[str, Any] = {}
    for c in live:  # in process, from the warm cache: the servers' own settings (--server-env included)
        settings = load_settings("prod", environ={**base, **c.env(cache), "INFERD__MODEL__PATH": str(model)})
        handlers[c.name] = load_handler(spec_from_settings(settings))
        if not reference.size and c == configs[0]:
            reference = np.asarray(handlers[c.name].infer(handlers[c.name].preprocess(corpus)), dtype=np.float64)
        rows[c.name]["accuracy"] = accuracy(handlers[c.name], corpus, reference)
        rows[c.name]["gate"] = (handlers[c.name].loaded.backend_info.get("gate") or {}).get("figures")
        rows[c.name]["dtype"] = handlers[c.name].loaded.dtype
        say(f"backends: {c.name}: accuracy {rows[c.name]['accuracy']}")

    externals: list[tuple[str, Callable[[], ServerProc]]] = []
    if args.infinity is not None:
        for engine in (e.strip() for e in args.infinity_engines.split(",") if e.strip()):
            externals.append((f"infinity {engine}", lambda e=engine: start_infinity(
                args.infinity, e, (args.infinity_onnx_model if e == "optimum" else None) or model, logs, threads,
                pooling=st_pooling(model))))
            rows[f"infinity {engine}"] = {"config": {"server": "infinity", "engine": engine}, "rounds": []}
    servers: list[tuple[str, Callable[[], ServerProc], Target]] = [
        (c.name, lambda c=c: start_inferd(logs, model, threads, {**base, **c.env(cache)}, timeout=600),
         Target("", client=args.client)) for c in live]
    servers += [(name, start, Target("", "/embeddings", "input", client=args.client)) for name, start in externals]
    for r in range(args.backend_rounds):
        for c in _rotated(live, r):
            tps = in_process(handlers[c.name], corpus, min_seconds=args.duration)
            rows[c.name]["rounds"].append({"round": r, "in_process": round(tps, 2)})
            say(f"backends: round {r + 1}: {c.name} in-process {tps:.1f} texts/s")
        for name, start, target in _rotated(servers, r):
            row = rows[name]
            if "error" in row:
                continue
            t0 = time.monotonic()
            try:
                server = start()
            except (ServerFailed, OSError) as exc:
                row["error"] = str(exc)[-3000:]
                say(f"backends: {name}: FAILED to start: {why_failed(row['error'])}")
                continue
            warm = time.monotonic() - t0
            try:
                if name.startswith("infinity") and "accuracy" not in row and reference.size:
                    got = infinity_vectors(server, corpus)
                    cos = cosine_rows(reference, got)
                    row["accuracy"] = {"cosine_min": round(float(cos.min()), 6),
                                       "cosine_mean": round(float(cos.mean()), 6),
                                       "overlap_at_10": round(overlap_at_k(reference, got), 4)}
                result = run_closed(Target(server.url, target.path, target.field, target.client), source, 32, 1,
                                    args.duration, args.warmup)
            except Exception as exc:  # noqa: BLE001 - one engine that breaks must not cost the others' figures
                row["error"] = f"{type(exc).__name__}: {exc}; its log: {server.log_path}"
                say(f"backends: {name}: FAILED while measured: {row['error'][-300:]}")
                continue
            finally:
                server.stop()
            entry = next((x for x in row["rounds"] if x["round"] == r), None)
            if entry is None:
                entry = {"round": r}
                row["rounds"].append(entry)
            entry.update({"warm_start_s": round(warm, 2), "server": result["texts_per_s"],
                          "server_errors": result.get("errors"), "p50_ms": result.get("p50_ms"),
                          "p99_ms": result.get("p99_ms")})
            say(f"backends: round {r + 1}: {name} server {result['texts_per_s']:.1f} texts/s (warm start "
                f"{warm:.1f} s)")
    for h in handlers.values():
        h.close()
    handlers.clear()
    return summarise(rows, configs[0].name if configs else None, ref_name)


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


# -- the report -------------------------------------------------------------------------------------------


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
