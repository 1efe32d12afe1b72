"""What a model folder's checkpoint holds, read from its headers before anything is built, against what its
config.json implies.

transformers builds the model config.json describes, allocating and initialising every tensor, and only then
reads the weights and reports those that did not fit: a config.json saying ``num_hidden_layers: 100000`` over a
two-layer checkpoint grew a process past 8 GB before any refusal could come (issue 39). The checkpoint's tensor
names and shapes cost nothing to read (a safetensors file starts with a JSON header; torch.load of a zip
checkpoint under ``mmap`` touches no tensor data), so the config is held to them first: the layers the
checkpoint holds, the word embedding's rows and width, and the parameter count of the model the config
describes, counted on torch's meta device (no memory), against the checkpoint's.

A checkpoint holding more layers than the config names is refused too: transformers would load the first ones
and drop the rest with only a warning, serving other vectors than the model's.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from inferd.core.backends.base import BackendError

# safetensors refuses headers over 100 MB itself; a header this size would name millions of tensors.
MAX_HEADER_BYTES = 100 * 2**20
# A numbered block of the model's stack: BERT's ``encoder.layer.3.``, DistilBERT's ``transformer.layer.3.``,
# ModernBERT's and the decoders' ``layers.3.`` (under whatever prefix the checkpoint's class gave them).
_LAYER = re.compile(r"^(?P<stack>(?:.*\.)?layers?)\.(?P<index>\d+)\.")
# The word embedding, by family: BERT and its kin, the decoders, ModernBERT.
_WORD_EMBEDDINGS = ("word_embeddings.weight", "embed_tokens.weight", "tok_embeddings.weight")
# The config's layer count, by the names the families give it (transformers maps most onto num_hidden_layers).
_LAYER_COUNT = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
# How far the parameters the config implies may exceed the checkpoint's: rounding of small tensors a checkpoint
# may leave out and transformers initialises (a bias, a norm), never a layer or a table of any size.
MARGIN_SHARE = 0.02
MARGIN_ELEMENTS = 4096
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Held:
    """A checkpoint's tensors by name (shape, bytes per element), and the files they were read from."""

    tensors: dict[str, tuple[tuple[int, ...], int]]
    files: tuple[str, ...]

    @property
    def elements(self) -> int:
        return sum(_numel(shape) for shape, _ in self.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(_numel(shape) * size for shape, size in self.tensors.values())

    @property
    def where(self) -> str:
        return ", ".join(self.files)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def safetensors_header(file: Path) -> dict[str, tuple[tuple[int, ...], int]] | None:
    """A safetensors file's tensors (shape, bytes per element) from its JSON header, no tensor data read; None
    when it is not one (the library's own read then names what is wrong, as it always has)."""
    try:
        with file.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than its header's length")
            (length,) = struct.unpack("<Q", raw)
            size = file.stat().st_size
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"its header claims {length} bytes")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        out: dict[str, tuple[tuple[int, ...], int]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"tensor {name!r} has no valid shape")
            out[name] = (tuple(shape), _ITEMSIZE.get(str(entry.get("dtype")), 4))
        return out
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def pickle_tensors(file: Path) -> dict[str, tuple[tuple[int, ...], int]] | None:
    """A pytorch_model.bin's tensors (shape, bytes per element), tensors only (``weights_only``): memory-mapped
    for a zip checkpoint (no data read); a legacy (pre-zip) one cannot be mapped and is read onto the meta
    device, which reads its bytes once (bounded by the file's size, as transformers' own read would be). None when
    it is not one (transformers' own read names what is wrong)."""
    try:
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:
            state = torch.load(file, map_location="meta", weights_only=True)
    except Exception:  # a damaged or hostile pickle: the unpickler raises nearly anything
        return None
    if not isinstance(state, dict):
        return None
    return {str(k): (tuple(v.shape), v.element_size()) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _index_shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(weight_map, dict):
        return []
    shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
    # Only files of the folder itself (core/loading.py refuses any other before a load; here none is opened).
    if any(Path(s).is_absolute() or ".." in Path(s).parts for s in shards):
        return []
    return [index.parent / s for s in shards]


def read_held(path: Path, safetensors: bool) -> Held | None:
    """The tensors of the checkpoint transformers would load from ``path`` (one file, or an index's shards);
    None when the folder holds none of the names it reads, or one that cannot be read (transformers then names
    what is wrong)."""
    stem, read = ("model.safetensors", safetensors_header) if safetensors else ("pytorch_model.bin", pickle_tensors)
    if (path / stem).is_file():
        files = [path / stem]
    elif (path / f"{stem}.index.json").is_file():
        files = _index_shards(path / f"{stem}.index.json")
    else:
        return None
    if not files:
        return None
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    for file in files:
        one = read(file) if file.is_file() else None
        if one is None:
            return None
        tensors.update(one)
    return Held(tensors, tuple(f.name for f in files))


def layers_held(names: list[str] | set[str] | dict[str, Any]) -> tuple[str, list[int]] | None:
    """The checkpoint's stack of numbered layers (the one with the most tensors) and the indices it holds."""
    stacks: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            stacks.setdefault(m["stack"], set()).add(int(m["index"]))
            counts[m["stack"]] = counts.get(m["stack"], 0) + 1
    if not stacks:
        return None
    stack = max(stacks, key=lambda s: counts[s])
    return stack, sorted(stacks[stack])


def _config_value(config: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def _span(indices: list[int]) -> str:
    return f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])


def check_config(path: Path, config: Any, held: Held) -> None:
    """Refuse a config.json the checkpoint's tensors contradict: the number of layers, the word embedding's
    width (``hidden_size``, or ELECTRA's ``embedding_size``) and rows (``vocab_size``); each refusal names the
    setting, the tensor, and both figures."""
    where = held.where
    layers = _config_value(config, _LAYER_COUNT)
    stack = layers_held(held.tensors)
    if layers is not None and stack is not None:
        name, count = layers
        prefix, indices = stack
        if count != len(indices):
            more = ("the layers past it would be dropped, serving other vectors than the model's"
                    if count < len(indices) else "the layers it lacks would be built at random")
            raise BackendError(
                f"{path.name}: config.json's {name} is {count}, the checkpoint ({where}) holds {len(indices)} "
                f"layers ({prefix}.{_span(indices)}): {more}; the config does not describe these weights")
    embedding = next((n for n in held.tensors if n.endswith(_WORD_EMBEDDINGS)), None)
    if embedding is None:
        return
    shape = held.tensors[embedding][0]
    if len(shape) != 2:
        raise BackendError(f"{path.name}: the checkpoint's {embedding} has shape {list(shape)}, not [rows, width]")
    width = _config_value(config, ("embedding_size", "hidden_size", "dim", "d_model"))
    if width is not None and width[1] != shape[1]:
        raise BackendError(f"{path.name}: config.json's {width[0]} is {width[1]}, the checkpoint's {embedding} "
                           f"({where}) is {shape[1]} wide; the config does not describe these weights")
    vocab = _config_value(config, ("vocab_size",))
    if vocab is not None and vocab[1] != shape[0]:
        raise BackendError(f"{path.name}: config.json's vocab_size is {vocab[1]}, the checkpoint's {embedding} "
                           f"({where}) has {shape[0]} rows; the config does not describe these weights")


def check_size(path: Path, skeleton: torch.nn.Module, held: Held, optional: tuple[str, ...] = (),
               itemsize: int = 4) -> int:
    """Refuse a config whose model (``skeleton``, built on the meta device) has more parameters than the
    checkpoint holds, beyond a small margin: every other setting that sizes a tensor (``intermediate_size``,
    ``max_position_embeddings``, heads) is held here. ``optional``: name parts of parameters a checkpoint may
    leave out (the pooler, when the task does not read it). Returns the parameters the config implies."""
    implied = sum(p.numel() for n, p in skeleton.named_parameters() if not any(o in n for o in optional))
    have = held.elements
    if implied > have + max(int(have * MARGIN_SHARE), MARGIN_ELEMENTS):
        raise BackendError(
            f"{path.name}: config.json describes a model of {implied:,} parameters ({_size(implied * itemsize)} to "
            f"build), the checkpoint ({held.where}) holds {have:,} ({_size(held.nbytes)}); the config does not "
            "describe these weights")
    return implied


def memory_available() -> int:
    """Bytes this process may still take: the machine's available memory, or less under a cgroup (v2) limit (a
    container's, which the machine's figure does not show)."""
    free = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def check_room(path: Path, nbytes: int, available: int) -> None:
    """Refuse a model whose weights (``nbytes``, built in host memory before they move to a device) do not fit in
    the memory left: the load would take the serving models down with it."""
    if nbytes > available:
        raise BackendError(f"{path.name}: the model needs {_size(nbytes)} to build, and this process has "
                           f"{_size(max(available, 0))} of memory left; it would not fit beside what serves")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def unexpected_layers(unexpected: list[str]) -> list[str]:
    """Of the keys a load left unused, those of a numbered layer: weights of the model's own stack the config
    does not name (a head's or a buffer's, unused by a task that does not read it, are not)."""
    return sorted(k for k in unexpected if _LAYER.match(k))
