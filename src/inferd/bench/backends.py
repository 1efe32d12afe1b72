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
as a separate server, with each of its engines, under the same load (bench/infinity.py); bench/backends_report.py
summarises and reports the figures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.bench.backends_report import summarise, why_failed
from inferd.bench.infinity import infinity_vectors, st_pooling, start_infinity
from inferd.bench.load import Target, TextSource, run_closed
from inferd.bench.procs import ServerFailed, ServerProc, start_inferd
from inferd.core.agreement import cosine_rows, overlap_at_k
from inferd.core.backends import gate_inputs, gate_shapes
from inferd.settings import BACKENDS, DTYPES, QUANTIZE

DEFAULT_CONFIGS = ("torch,torch:padded,torch:bfloat16,onnx,onnx:int8,openvino,openvino:bfloat16,"
                   "openvino:int8-weights,openvino:int8")
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "auto", "mixed": "mixed"}


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
    filler = gate_inputs.at_limit(handler, texts)
    mins, means, overlaps = [], [], []
    for plan in gate_shapes.plans(0).values():
        got = gate_shapes.outputs(handler, handler.runner, items, plan(items), filler)
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


# -- the phase -------------------------------------------------------------------------------------------


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
