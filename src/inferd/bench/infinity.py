"""Infinity (michaelfeil/infinity, a separate installation) as a server beside inferd's in the backends phase."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from inferd.bench.procs import ServerProc, _base_env, _spawn, free_port


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
