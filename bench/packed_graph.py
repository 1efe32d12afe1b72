"""Packed sequences on OpenVINO: several texts in one row of a batch, each attending only to itself, against the
padded batches the server forms from one-text traffic (issue 43 item 5's compute half).

    python bench/packed_graph.py [--rounds 2]

MiniLM (the packaged folder) is exported twice with ``openvino.convert_model``: the padded graph the server serves
(ids and a [batch, length] mask) and a packed one whose inputs are the ids, each token's position within its own
text and each token's text number in its row (0: padding); the packed graph builds the block-diagonal attention mask
inside itself (a text's tokens see only that text's). Both are marked as ``model.dtype: mixed`` marks them
(core/backends/precision.py) and compiled as a server instance runs them (one stream, one thread). The packed
vectors are checked against the padded ones (cosine), then CPU time per text over the corpus in random arrival
order, in windows of 24 (what waits at each take under 32 one-text clients, bench/RESULTS.md):

- padded under the floor: each window sorted and cut wherever a batch would keep under 90% real tokens (the
  scheduler's ``min_padding_efficiency``), as the server at best forms them;
- packed: each window in two halves of 12 (two instances), each half one pass, its texts packed first-fit
  decreasing into rows as wide as its longest text, or 128, or 256 tokens;
- and the ceiling: the whole corpus sorted, batches of 32, padded graph.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd import corpus
from inferd.core.backends import precision
from inferd.settings.model import ModelSettings, resolve_model_path


class Packed(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        allow = ((segments[:, :, None] == segments[:, None, :]) & (segments > 0)[:, None, :])[:, None, :, :]
        mask = torch.zeros(allow.shape, dtype=torch.float32).masked_fill(~allow, torch.finfo(torch.float32).min)
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                          token_type_ids=torch.zeros_like(input_ids)).last_hidden_state


class Padded(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=torch.zeros_like(input_ids)).last_hidden_state


def compiled(core: Any, work: Path, name: str, wrapper: torch.nn.Module, example: dict[str, torch.Tensor],
             streams: int = 1, threads: int = 1, **extra: Any) -> Any:
    """The wrapper exported into ``work`` (once), marked as ``mixed`` is, compiled with ``streams`` of ``threads``."""
    import openvino as ov

    path = work / f"{name}.xml"
    if not path.exists():
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            graph = ov.convert_model(wrapper, example_input=example,
                                     input=[(k, [-1, -1], ov.Type.i64) for k in example])
        ov.save_model(graph, str(path), compress_to_fp16=False)
    with tempfile.TemporaryDirectory() as tmp:
        simplified = precision.simplified(core, path, Path(tmp))
        xml, _ = precision.marked(simplified, core.read_model(str(simplified)))
        graph = core.read_model(xml, ov.Tensor(np.fromfile(simplified.with_suffix(".bin"), dtype=np.uint8)))
    return core.compile_model(graph, "CPU", {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY",
                                             "NUM_STREAMS": str(streams), "INFERENCE_NUM_THREADS": threads, **extra})


def padded_example() -> dict[str, torch.Tensor]:
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 4:] = 0
    return {"input_ids": torch.full((2, 8), 5), "attention_mask": mask}


def load_model() -> tuple[Any, torch.nn.Module]:
    from transformers import AutoModel, AutoTokenizer

    folder = resolve_model_path(ModelSettings())  # the packaged MiniLM
    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder, attn_implementation="eager").eval()


def feed(enc: list[list[int]], group: list[int]) -> dict[str, np.ndarray]:
    length = max(len(enc[i]) for i in group)
    ids = np.zeros((len(group), length), np.int64)
    mask = np.zeros_like(ids)
    for row, i in enumerate(group):
        ids[row, :len(enc[i])] = enc[i]
        mask[row, :len(enc[i])] = 1
    return {"input_ids": ids, "attention_mask": mask}


def rows_of(enc: list[list[int]], group: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: each text into the first row with room for it."""
    rows: list[tuple[int, list[int]]] = []
    for i in sorted(group, key=lambda i: -len(enc[i])):
        for k, (used, members) in enumerate(rows):
            if used + len(enc[i]) <= width:
                rows[k] = (used + len(enc[i]), [*members, i])
                break
        else:
            rows.append((len(enc[i]), [i]))
    return [members for _, members in rows]


def floor_batches(enc: list[list[int]], window: list[int], floor: float = 0.9) -> list[list[int]]:
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(window, key=lambda i: len(enc[i])):
        trial = [*current, i]
        if current and sum(len(enc[j]) for j in trial) / (len(trial) * len(enc[i])) < floor:
            batches.append(current)
            current = [i]
        else:
            current = trial
    return [*batches, current] if current else batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import openvino as ov

    torch.set_num_threads(1)
    tok, model = load_model()
    core = ov.Core()
    work = Path(tempfile.mkdtemp(prefix="packed-graph-"))
    ids, seg = torch.full((2, 8), 5), torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 0, 0]])
    packed = compiled(core, work, "packed", Packed(model),
                      {"input_ids": ids, "position_ids": pos, "segments": seg}).create_infer_request()
    padded = compiled(core, work, "padded", Padded(model), padded_example()).create_infer_request()
    texts = corpus.texts(2048)
    enc = [tok(t, truncation=True, max_length=256)["input_ids"] for t in texts]

    def run_padded(group: list[int]) -> dict[int, np.ndarray]:
        padded.infer(feed(enc, group), share_inputs=True)
        hidden = padded.get_output_tensor(0).data
        return {i: hidden[row, :len(enc[i])].mean(0) for row, i in enumerate(group)}

    def run_packed(group: list[int], width: int | None) -> dict[int, np.ndarray]:
        rows = rows_of(enc, group, max(max(len(enc[i]) for i in group), width or 0))
        length = max(sum(len(enc[i]) for i in row) for row in rows)
        ids, pos, seg = (np.zeros((len(rows), length), np.int64) for _ in range(3))
        spans = {}
        for r, row in enumerate(rows):
            at = 0
            for k, i in enumerate(row):
                n = len(enc[i])
                ids[r, at:at + n], pos[r, at:at + n], seg[r, at:at + n] = enc[i], np.arange(n), k + 1
                spans[i] = (r, at, n)
                at += n
        packed.infer({"input_ids": ids, "position_ids": pos, "segments": seg}, share_inputs=True)
        hidden = packed.get_output_tensor(0).data
        return {i: hidden[r, at:at + n].mean(0) for i, (r, at, n) in spans.items()}

    a, b = run_padded(list(range(24))), run_packed(list(range(24)), 128)
    cosines = [float(a[i] @ b[i] / np.linalg.norm(a[i]) / np.linalg.norm(b[i])) for i in a]
    print(f"packed against padded, 24 texts: cosine min {min(cosines):.6f}")

    order = list(range(len(texts)))
    random.Random(1).shuffle(order)
    windows = [order[k:k + 24] for k in range(0, len(order) - 23, 24)]

    def measure(name: str, passes: Callable[[list[int]], Iterator[list[int]]]) -> None:
        for w in windows[:4]:
            list(passes(w))
        cpu0, n, count = time.process_time(), 0, 0
        for w in windows:
            count += len(list(passes(w)))
            n += len(w)
        print(f"{name}: {(time.process_time() - cpu0) / n * 1000:.3f} ms of CPU a text, {n / count:.1f} texts a pass")

    def under_floor(w: list[int]) -> Iterator[list[int]]:
        for b in floor_batches(enc, w):
            run_padded(b)
            yield b

    def packed_in_halves(width: int | None) -> Callable[[list[int]], Iterator[list[int]]]:
        def passes(w: list[int]) -> Iterator[list[int]]:
            for half in (w[:12], w[12:]):
                run_packed(half, width)
                yield half
        return passes

    ordered = sorted(range(len(texts)), key=lambda i: len(enc[i]))
    for _ in range(args.rounds):
        cpu0 = time.process_time()
        for k in range(0, len(ordered), 32):
            run_padded(ordered[k:k + 32])
        cost = (time.process_time() - cpu0) / len(ordered) * 1000
        print(f"sorted batches of 32, padded: {cost:.3f} ms of CPU a text")
        measure("padded under the 0.9 floor", under_floor)
        for width in (None, 128, 256):
            measure(f"packed, 12 a pass, rows of {width or 'the longest'}", packed_in_halves(width))


if __name__ == "__main__":
    main()
