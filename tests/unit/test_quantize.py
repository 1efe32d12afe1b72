"""core/quantize.py against sentence-transformers' own quantize_embeddings, and the Matryoshka cut."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers.quantization import quantize_embeddings

from inferd.core import quantize as q


def _vectors(n: int = 40, dim: int = 37, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, dim)).astype(np.float32)


@pytest.mark.parametrize("precision", ["binary", "ubinary"])
def test_sign_bits_are_packed_as_sentence_transformers_packs_them(precision: str) -> None:
    v = _vectors(dim=37)  # not a multiple of 8: the last byte is padded with zero bits
    v[0, :8] = [1, -1, 1, -1, 0, 1, 1, 1]  # 0 is not positive: its bit is 0
    got = q.quantize(v, precision)
    want = quantize_embeddings(v, precision)
    assert got.dtype == want.dtype and got.shape == (40, 5)
    np.testing.assert_array_equal(got, want)
    assert int(np.packbits(v[:1] > 0)[0]) == 0b10100111
    if precision == "binary":
        assert got[0, 0] == 0b10100111 - 128


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_scalar_buckets_equal_quantize_embeddings_given_the_same_ranges(precision: str) -> None:
    calibration = _vectors(n=300, seed=1)
    ranges = q.ranges_of(calibration)
    np.testing.assert_array_equal(ranges, np.vstack((calibration.min(0), calibration.max(0))))
    # Values past the calibrated range (3x wider than it) land in the end buckets, as in sentence-transformers.
    v = _vectors(n=50, seed=2) * 3
    got = q.quantize(v, precision, ranges)
    want = quantize_embeddings(v, precision, ranges=ranges)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    lo, hi = (-128, 127) if precision == "int8" else (0, 255)
    assert got.min() == lo and got.max() == hi  # clipped, never wrapped around
    # Equal also to calibrating from the embeddings themselves (quantize_embeddings' calibration_embeddings).
    np.testing.assert_array_equal(got, quantize_embeddings(v, precision, calibration_embeddings=calibration))


def test_a_component_with_no_range_does_not_divide_by_zero() -> None:
    calibration = _vectors(n=10)
    calibration[:, 3] = 0.25
    ranges = q.ranges_of(calibration)
    v = _vectors(n=5, seed=3)
    np.testing.assert_array_equal(q.quantize(v, "int8", ranges), quantize_embeddings(v, "int8", ranges=ranges))


def test_scalar_precisions_need_ranges_and_unknown_ones_are_refused() -> None:
    with pytest.raises(ValueError, match="calibration ranges"):
        q.quantize(_vectors(), "int8")
    with pytest.raises(ValueError, match="unknown precision"):
        q.quantize(_vectors(), "int4")
    with pytest.raises(ValueError, match="two vectors"):
        q.ranges_of(_vectors(n=1))


def test_shorten_keeps_the_first_components_and_renormalises_only_when_asked() -> None:
    v = q.unit(_vectors(dim=64))
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    cut = q.shorten(v, 16, renormalise=True)
    assert cut.shape == (40, 16)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)
    # The direction is the first 16 components' (what sentence-transformers' truncate_dim then normalize gives).
    np.testing.assert_allclose(cut, v[:, :16] / np.linalg.norm(v[:, :16], axis=1, keepdims=True), atol=1e-6)
    raw = q.shorten(v, 16, renormalise=False)
    np.testing.assert_array_equal(raw, v[:, :16])
    assert q.shorten(v, None, renormalise=True) is not None and q.shorten(v, None, True).shape == (40, 64)
    assert q.shorten(v, 64, renormalise=True).shape == (40, 64)
    zero = np.zeros((1, 8), dtype=np.float32)
    np.testing.assert_array_equal(q.unit(zero), zero)


def test_base64_is_little_endian_float32() -> None:
    v = _vectors(n=3, dim=5)
    for row, text in zip(v, q.as_base64(v), strict=True):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(text), dtype="<f4"), row)


def test_calibration_texts_are_the_builtin_set_or_the_operators_file(tmp_path: Path) -> None:
    builtin = q.calibration_texts(None)
    assert len(builtin) == q.CALIBRATION_COUNT and builtin == q.calibration_texts(None)  # seeded, stable
    assert len(set(builtin)) == len(builtin)
    path = tmp_path / "texts.jsonl"
    lines = [json.dumps({"text": f"text number {i}"}) for i in range(30)]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    assert q.calibration_texts(path) == [f"text number {i}" for i in range(30)]
