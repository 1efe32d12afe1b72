"""What an embedding becomes on its way out: shortened (Matryoshka), and in the precision a client asked for.

Pure numpy on finished vectors, so every wire API shapes vectors alike and the result cache keeps the model's
full float vectors only (a shorter or quantised answer is computed from them, never stored).

- **Matryoshka**: a model trained for it keeps most of its quality in its first ``d`` components; the vector is
  cut to them, then renormalised when the model's vectors are unit length (a unit vector cut short is not one:
  renormalising keeps the dot product a cosine at every size, as OpenAI and text-embeddings-inference answer).
- **binary / ubinary**: one sign bit per component (``x > 0``), packed big-end first into bytes, ``ubinary``
  as uint8, ``binary`` the same byte minus 128 as int8: ``sentence_transformers.quantization.quantize_embeddings``.
- **int8 / uint8**: each component scaled to 256 buckets between that component's minimum and maximum over a
  set of calibration vectors (``ranges``), floor, clipped to the buckets; int8 is the bucket minus 128. Equal to
  ``quantize_embeddings(..., ranges=ranges)`` (sentence-transformers 5+, which floors and clips: values outside
  the calibrated range land in the end buckets instead of wrapping around).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Literal

import numpy as np

from inferd import corpus
from inferd.core.backends.gate_inputs import read_calibration_file

Precision = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
PRECISIONS: tuple[str, ...] = ("float", "int8", "uint8", "binary", "ubinary", "base64")
# The built-in calibration texts: the corpus generator with a seed of their own (the accuracy gate's texts
# use another), as many as int8 calibration of the model's graph measures by default.
CALIBRATION_SEED = 21_2025
CALIBRATION_COUNT = 300


def shorten(vectors: np.ndarray, dimensions: int | None, renormalise: bool) -> np.ndarray:
    """The first ``dimensions`` components of each row (all when None), unit length again if ``renormalise``."""
    out = np.asarray(vectors, dtype=np.float32)
    if dimensions is not None and dimensions < out.shape[-1]:
        out = out[..., :dimensions]
        if renormalise:
            out = unit(out)
    return out


def unit(vectors: np.ndarray) -> np.ndarray:
    """Each row at length 1 (a zero row stays zero), computed in float64 as text-embeddings-inference does."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    return (v / np.where(norms == 0, 1.0, norms)).astype(np.float32)


def ranges_of(calibration: np.ndarray) -> np.ndarray:
    """Per-component (min, max) over calibration vectors: shape (2, dim), as quantize_embeddings computes."""
    c = np.asarray(calibration, dtype=np.float32)
    if c.ndim != 2 or len(c) < 2:
        raise ValueError("calibration needs at least two vectors")
    return np.vstack((c.min(axis=0), c.max(axis=0)))


def quantize(vectors: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """``vectors`` (n, dim) float in ``precision``; int8 and uint8 need ``ranges`` (see ranges_of)."""
    v = np.asarray(vectors, dtype=np.float32)
    if precision in ("float", "base64"):
        return v
    if precision == "ubinary":
        return np.packbits(v > 0, axis=-1)
    if precision == "binary":
        return (np.packbits(v > 0, axis=-1).astype(np.int16) - 128).astype(np.int8)
    if precision in ("int8", "uint8"):
        if ranges is None:
            raise ValueError(f"{precision} needs calibration ranges")
        r = np.asarray(ranges, dtype=np.float32)
        starts = r[0]
        steps = (r[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((v - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    raise ValueError(f"unknown precision {precision!r}")


def as_base64(vectors: np.ndarray) -> list[str]:
    """Each row's little-endian float32 bytes in base64 (OpenAI's and Cohere's ``base64``)."""
    rows = np.asarray(vectors, dtype="<f4")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]


def calibration_texts(calibration_file: str | Path | None) -> list[str]:
    """The texts int8/uint8 ranges are measured on: the operator's ``model.calibration_file`` (one text a line,
    or JSON lines with ``"text"``, as the backends' calibration reads it), else the built-in multilingual set."""
    if calibration_file is None:
        return corpus.texts(CALIBRATION_COUNT, CALIBRATION_SEED)
    return read_calibration_file(Path(calibration_file).expanduser())
