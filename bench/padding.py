"""Padding cost on the CPU: three ways not to pay for padded positions, measured on all-MiniLM-L6-v2.

Run: .venv/bin/python bench/padding.py [--repeats 5] [--seconds 1.0] [--threads 2] [--clock wall|cpu]

(a) what inferd has: dynamic shapes (torch eager, ONNX Runtime, OpenVINO) and length-grouped batches; every
    row still runs to the batch's longest text;
(b) unpadded ("varlen") torch, core/backends/varlen.py: the real tokens of a batch packed into one
    [tokens, hidden] matrix for the embeddings, projections, layer norms and feed-forward; attention per
    sequence, as a loop of scaled_dot_product_attention over each sequence's slice, or one call on a jagged
    nested tensor, or (for comparison) padded back for one masked call;
(c) jagged nested tensors (torch.nested, layout=torch.jagged) through every layer.

Batches: (i) 32 texts of similar length (what the scheduler's length grouping gives), (ii) 32 texts of mixed
length 8..256 tokens (a batch without grouping), (iii) 1 text. Per method and batch: texts/s (median and
min-max over the repeats; the methods run in a rotated order in each repeat; a repeat's figure is the fastest
of the calls made in --seconds), the ratio to padded torch fp32
in the same repeat, real tokens/s, and the cosine min of its pooled, normalised outputs to padded torch
fp32's. A method that fails says so (first line of the error) instead of a figure.
Progress goes to stderr, the markdown table to stdout.

Measured 2026-12-01 (``--threads 1 --clock cpu``: the machine was shared, and CPU seconds on one thread are what
other processes inflate least), ratio to padded torch fp32, median (min-max) of 5 repeats:
(ii) mixed: varlen with the attention loop 1.72 (1.45-2.27), with padded attention 1.73 (1.55-1.87), nested
attention 0.57, jagged nested tensors 0.58, ONNX Runtime 0.53, OpenVINO 1.04; (i) similar: varlen 1.02
(0.87-1.07); (iii) one text: varlen 1.20 (0.96-1.45). All at cosine 1.000000 to padded torch. Hence
core/backends/varlen.py with the attention loop (model.unpadded: auto); docs/backends.md has the summary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from inferd.core.backends import varlen
from inferd.core.backends.torch import TorchRunner
from inferd.core.loading import load_handler
from inferd.core.preprocess import Encoded
from inferd.core.spec import ModelSpec
from inferd.core.tasks.embedding import EmbeddingHandler
from inferd.corpus import texts as corpus_texts
from inferd.settings import ModelSettings, resolve_model_path

Forward = Callable[..., torch.Tensor]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the batches ------------------------------------------------------------------------------------------


def batches(handler: EmbeddingHandler) -> dict[str, list[Encoded]]:
    """(i) 32 neighbours in length order around the corpus median, (ii) 32 texts whose lengths step from 8 to
    the limit, (iii) the median text alone."""
    pool = corpus_texts(2000, seed=11)
    # Long passages (the corpus stops at 250 tokens): consecutive texts joined, truncated at the limit.
    pool += [" ".join(pool[i:i + k]) for k in (2, 3, 5, 8) for i in range(0, 400, 7)]
    encoded = handler.preprocess(pool)
    by_length = sorted(range(2000), key=lambda i: encoded[i].tokens)
    middle = len(by_length) // 2
    similar = [encoded[i] for i in by_length[middle - 16:middle + 16]]
    mixed, used = [], set()
    for target in np.linspace(8, handler.max_seq_length, 32):
        best = min((i for i in range(len(encoded)) if i not in used),
                   key=lambda i: abs(encoded[i].tokens - target))
        used.add(best)
        mixed.append(encoded[best])
    return {"(i) 32 similar": similar, "(ii) 32 mixed": mixed, "(iii) 1 text": [encoded[by_length[middle]]]}


def describe_batch(batch: list[Encoded]) -> dict[str, float]:
    real = sum(e.tokens for e in batch)
    padded = len(batch) * max(e.tokens for e in batch)
    return {"texts": len(batch), "real": real, "padded": padded, "min": min(e.tokens for e in batch),
            "max": max(e.tokens for e in batch), "efficiency": real / padded}


# -- the methods ------------------------------------------------------------------------------------------


def attention_nested(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: varlen.Packed,
                     heads: int) -> torch.Tensor:
    """(b) with one scaled_dot_product_attention call on jagged nested views of the packed projections."""
    offsets = torch.tensor(packed.offsets, dtype=torch.int64)
    size = q.shape[1] // heads

    def nest(t: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(t, offsets).unflatten(-1, (heads, size)).transpose(1, 2)

    ctx = F.scaled_dot_product_attention(nest(q), nest(k), nest(v))
    return ctx.transpose(1, 2).values().reshape(-1, heads * size)


def nested_forward(model: Any, ids: torch.Tensor, mask: torch.Tensor,
                   token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(c) one jagged nested tensor [batch, j, hidden] through the embeddings and every layer."""
    packed = varlen.pack(mask)
    offsets = torch.tensor(packed.offsets, dtype=torch.int64)
    length = packed.shape[1]

    def nest(t: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(t, offsets)

    emb = model.embeddings
    x = emb.word_embeddings(nest(ids.reshape(-1)[packed.index]))
    x = x + emb.position_embeddings(nest(packed.index % length))
    x = emb.LayerNorm(x + emb.token_type_embeddings.weight[0])
    for layer in model.encoder.layer:
        sa = layer.attention.self
        heads, size = sa.num_attention_heads, sa.attention_head_size

        def split(t: torch.Tensor, heads: int = heads, size: int = size) -> torch.Tensor:
            return t.unflatten(-1, (heads, size)).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(split(sa.query(x)), split(sa.key(x)), split(sa.value(x)))
        ctx = ctx.transpose(1, 2).flatten(-2)
        x = layer.attention.output.LayerNorm(layer.attention.output.dense(ctx) + x)
        hidden = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(x))
        x = layer.output.LayerNorm(layer.output.dense(hidden) + x)
    return varlen.unpack(x.values(), packed)


class Eager:
    """A forward function as a runner (fp32, or bf16 under CPU autocast like TorchRunner)."""

    def __init__(self, model: Any, fn: Callable[..., torch.Tensor], bf16: bool = False,
                 **kwargs: Any) -> None:
        self.model, self.fn, self.bf16, self.kwargs = model, fn, bf16, kwargs

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return self.fn(self.model, ids, mask, None, **self.kwargs)


def methods(handler: EmbeddingHandler, folder: Path, threads: int) -> dict[str, Callable[[], Any]]:
    """name -> a function that builds the runner (built lazily, so one that fails is reported, not fatal)."""
    from inferd.core.backends import onnx, openvino

    model = handler.runner.model  # the loaded BertModel, fp32, shared by every torch method
    padded = TorchRunner(model, torch.device("cpu"))  # transformers' own forward, whatever model.unpadded says

    def graph(kind: str, dtype: str) -> Any:
        if kind == "onnx":
            path = folder / "onnx" / onnx.GRAPH
            if not path.exists():
                onnx.export(model, path.parent)
            return onnx.OnnxRunner(path, dtype, "none", threads)
        path = folder / "openvino" / openvino.GRAPH
        if not path.exists():
            openvino.export(model, path.parent)
        return openvino.OpenVINORunner(path, dtype, "none", threads)

    return {
        "(a) torch padded fp32": lambda: padded,
        "(a) ONNX Runtime fp32": lambda: graph("onnx", "float32"),
        "(a) OpenVINO fp32": lambda: graph("openvino", "float32"),
        "(b) varlen, attention loop, fp32": lambda: varlen.VarlenRunner(model, torch.device("cpu")),
        "(b) varlen, nested attention, fp32": lambda: Eager(model, varlen.forward, attention=attention_nested),
        "(b) varlen, padded attention, fp32": lambda: Eager(model, varlen.forward, attention=varlen.attention_padded),
        "(c) jagged nested tensors, fp32": lambda: Eager(model, nested_forward),
        "(a) torch padded bf16 autocast": lambda: TorchRunner(model, torch.device("cpu"), "bfloat16"),
        "(a) OpenVINO bf16": lambda: graph("openvino", "bfloat16"),
        "(b) varlen, attention loop, bf16 autocast": lambda: varlen.VarlenRunner(model, torch.device("cpu"),
                                                                                 "bfloat16"),
    }


# -- measuring --------------------------------------------------------------------------------------------


def timed(handler: EmbeddingHandler, runner: Any, batch: list[Encoded], seconds: float,
          clock: Callable[[], float] = time.perf_counter) -> tuple[float, np.ndarray]:
    """Seconds per batch on ``clock``: the fastest of the calls made in ``seconds`` (at least two), and the
    outputs.

    The fastest, not the mean: on a small machine shared with other work, a call that another process
    interrupts says nothing about the method, and the interruptions fall on the methods unevenly.
    """
    best, started = float("inf"), time.perf_counter()
    calls = 0
    while True:
        t0 = clock()
        out = handler.forward(runner, batch)
        best = min(best, clock() - t0)
        calls += 1
        if time.perf_counter() - started >= seconds and calls >= 2:
            return best, out


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0, help="least time per measurement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU seconds per batch, which other processes on a shared machine do "
                        "not inflate (with --threads 1 it is the cost on one dedicated core)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    path = resolve_model_path(ModelSettings())
    handler: EmbeddingHandler = load_handler(ModelSpec(path=path, name="minilm", version="1", device="cpu",
                                                       warmup=False))  # type: ignore[assignment]
    shapes = batches(handler)
    with tempfile.TemporaryDirectory(prefix="inferd-padding-") as tmp:
        builders = methods(handler, Path(tmp), args.threads)
        reference_runner = next(iter(builders.values()))()  # torch padded fp32: what every ratio is to
        reference = {name: handler.forward(reference_runner, b) for name, b in shapes.items()}
        runners: dict[str, Any] = {}
        failed: dict[str, str] = {}
        cos: dict[tuple[str, str], float] = {}
        for name, build in builders.items():
            say(f"building {name}")
            try:
                runners[name] = build()
                for shape, b in shapes.items():  # warm up, and check, every shape once
                    cos[shape, name] = cosine_min(reference[shape], handler.forward(runners[name], b))
            except Exception as exc:  # a method the kernels do not support: reported in the table
                failed[name] = first_line(exc)
                runners.pop(name, None)
                say(f"  fails: {failed[name]}")
        names = list(runners)
        rate: dict[tuple[str, str], list[float]] = {}
        ratio: dict[tuple[str, str], list[float]] = {}
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for shape, b in shapes.items():
                seconds: dict[str, float] = {}
                for name in order:
                    seconds[name], out = timed(handler, runners[name], b, args.seconds, clock)
                    cos[shape, name] = min(cos[shape, name], cosine_min(reference[shape], out))
                    rate.setdefault((shape, name), []).append(len(b) / seconds[name])
                base = seconds[names[0]]
                for name in order:
                    ratio.setdefault((shape, name), []).append(base / seconds[name])
                say(f"repeat {r + 1}/{args.repeats} {shape}: " + ", ".join(
                    f"{n} {len(b) / seconds[n]:.1f}/s" for n in names))
        for runner in runners.values():
            if hasattr(runner, "close"):
                runner.close()
    print(render(shapes, names, failed, rate, ratio, cos, args))
    handler.close()


def spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def render(shapes: dict[str, list[Encoded]], names: list[str], failed: dict[str, str],
           rate: dict[tuple[str, str], list[float]], ratio: dict[tuple[str, str], list[float]],
           cos: dict[tuple[str, str], float], args: argparse.Namespace) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"all-MiniLM-L6-v2, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads, "
             f"{args.clock} clock, {args.repeats} repeats of >= {args.seconds:g} s per measurement; load average "
             f"at the end {load} (other work on the machine shows here)", "",
             "| batch | texts | tokens min–max | real tokens | padded tokens | real/padded |",
             "|---|---|---|---|---|---|"]
    for shape, b in shapes.items():
        d = describe_batch(b)
        lines.append(f"| {shape} | {d['texts']} | {d['min']}–{d['max']} | {d['real']} | {d['padded']} | "
                     f"{d['efficiency']:.2f} |")
    lines += ["", "| batch | method | texts/s median (min–max) | × torch padded fp32 (min–max) | real tokens/s | "
              "cosine min to torch padded fp32 |", "|---|---|---|---|---|---|"]
    for shape, b in shapes.items():
        real = describe_batch(b)["real"] / len(b)
        for name in names:
            texts = rate[shape, name]
            lines.append(f"| {shape} | {name} | {spread(texts, 1)} | {spread(ratio[shape, name], 2)} | "
                         f"{statistics.median(texts) * real:,.0f} | {cos[shape, name]:.6f} |")
        for name, why in failed.items():
            lines.append(f"| {shape} | {name} | fails: {why} | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
