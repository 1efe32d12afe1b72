"""Static int8 variants on all-MiniLM-L6-v2: the accuracy gate's figures and the in-process speed of each.

Run: .venv/bin/python bench/int8_variants.py [--variants JSON] [--rounds 3] [--work DIR]

Every variant quantises the same OpenVINO fp32 graph with NNCF (300 built-in calibration texts, as the server
does) and is judged by the server's own gate code on its 256 built-in texts at four batch shapes, against torch
fp32. Speed: texts/s on 512 corpus texts (tokenise + forward, sorted batches of 32, 2 threads), median over the
rounds; ``x_torch`` is that over inferd's default torch runner (unpadded) measured before and after it. A variant
is a JSON object: ``name`` (required; "fp32" is the unquantised graph), ``dtype`` (the float parts' inference
precision: float32 or bfloat16), ``alpha`` (SmoothQuant, 0.8), ``keep_down`` (the feed-forward down-projections
stay in float; true), ``overflow`` (NNCF's overflow fix: disable | first_layer | enable; NNCF's default when
omitted), ``preset`` (MIXED | PERFORMANCE). Quantised graphs are kept in --work, so a rerun only measures.
One JSON line per variant on stdout; progress on stderr.

Measured 2026-12-01 on an AMD EPYC (Zen 3, AVX2 only, no VNNI), 3 rounds, torch 93 texts/s:
fp32 graph 0.99x, cosine 1.0; server's static int8 (down-projections kept, alpha 0.8) 0.82x, cosine min 0.9857,
overlap@10 0.923 (refused); every product quantised 0.73-0.84x (two runs), 0.9714 / 0.892; with overflow_fix
enable 0.68x, 0.98997 / 0.937 (refused). bf16 float parts gave the float32 figures bit for bit: the CPU has no bf16, and
OpenVINO ignores the hint. bench/RESULTS.md "Run D" has the context.

Measured 2026-12-01 on an AMD EPYC (Zen 5: AVX512-BF16, AVX512-VNNI, no AMX), 3 rounds, torch ~130 texts/s:
fp32 graph 1.79x, cosine 1.0; bf16 graph 3.15x, 0.99995 / 0.995; server's static int8 2.82x, 0.9952 / 0.957
(passes); the same with bf16 float parts 3.92x, 0.9949 / 0.954 (passes: what dtype auto now tries first);
every product quantised 4.25x (bf16 parts 4.59x) but 0.977 / 0.913 (refused). bench/RESULTS.md "Run E".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from inferd.bench.backends import in_process
from inferd.core.backends import gate, gate_inputs
from inferd.core.backends import openvino as ovb
from inferd.core.backends.torch import TorchRunner, load_model
from inferd.core.loading import load_handler
from inferd.core.spec import ModelSpec
from inferd.corpus import texts as corpus_texts
from inferd.settings import ModelSettings, resolve_model_path

DEFAULT = ('[{"name": "fp32"}, {"name": "server"}, {"name": "all", "keep_down": false}, '
           '{"name": "overflow", "overflow": "enable"}]')


def quantise(fp32: Path, out: Path, calib: list[dict[str, Any]], **knobs: Any) -> Path:
    """The server's static int8 (openvino.quantize_static) with this variant's knobs; kept in ``out``."""
    if (out / ovb.GRAPH).exists():
        return out / ovb.GRAPH
    graph = ovb.read(fp32)
    names = [i.get_any_name() for i in graph.inputs]
    return ovb.save(ovb.quantize_static(graph, gate_inputs.only_inputs(calib, names), len(calib), **knobs), out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=DEFAULT, help="a JSON list of variants (see the module's docstring)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/inferd-int8-variants"))
    args = p.parse_args()
    variants = json.loads(args.variants)
    torch.set_num_threads(2)
    model = resolve_model_path(ModelSettings())
    handler = load_handler(ModelSpec(path=model, name="minilm", version="1", device="cpu", warmup=False))
    default = handler.runner
    reference = TorchRunner(load_model(model, True), torch.device("cpu"), "float32")
    gate_texts = gate_inputs.builtin_texts(256)
    calibration_texts = gate_inputs.builtin_texts(300, gate_inputs.CALIBRATION_SEED)
    calib = gate_inputs.calibration_samples(handler, gate_inputs.encode_set(handler, calibration_texts))
    texts = corpus_texts(512)
    fp32 = args.work / "fp32" / ovb.GRAPH
    if not fp32.exists():
        print("exporting the fp32 graph", file=sys.stderr)
        ovb.export(load_model(model, True), fp32.parent)

    def speed(runner: Any, rounds: int) -> float:
        handler.runner = runner
        try:
            in_process(handler, texts[:64])  # warm-up
            return statistics.median(in_process(handler, texts) for _ in range(rounds))
        finally:
            handler.runner = default

    for v in variants:
        v = dict(v)
        name, dtype = v.pop("name"), v.pop("dtype", "float32")
        print(f"{name}: quantising and judging", file=sys.stderr)
        graph = fp32 if name == "fp32" else quantise(fp32, args.work / name, calib, **v)
        runner = ovb.OpenVINORunner(graph, dtype, "none" if name == "fp32" else "int8", 2)
        figures = gate.measure(handler, reference, runner, gate_texts)
        before = speed(default, 1)
        mine = speed(runner, args.rounds)
        after = speed(default, 1)
        runner.close()
        print(json.dumps({"name": name, "dtype": dtype, **v, "texts_per_s": round(mine, 1),
                          "x_torch": round(mine / statistics.mean([before, after]), 2),
                          "cosine_min": figures.cosine_min, "cosine_mean": figures.cosine_mean,
                          "overlap_at_10": figures.overlap_at_10}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
