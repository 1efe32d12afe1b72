"""What the embedding wire APIs share (OpenAI's /v1/embeddings, TEI's /embed and /similarity, Cohere's embed):
a request's encoding choices of its texts (the options the engine takes beside them), and the answer's size and
precision, shaped by the description of the model load that computed the result (core/outcomes.py TaskResult), never
by a slot looked up again.

- **Prompts** are chosen by the route (core/prompts.py Prompt: a name, Cohere's input type, or the default) and
  resolved by the engine on the slot that runs the request: a canary encodes with its own prompts.
- **Sizes**: the engine refuses a size the model does not allow (core/tasks/task.py wrong_dimensions); the
  vectors come back whole and are cut here (core/quantize.py), so the result cache keeps full vectors and a
  text's entry serves every size.
- **int8 / uint8** need per-component ranges: the engine measures them once per model load on the calibration
  texts, on the very slot that answered, and hands them back with the result (``calibrate``); each size gets its
  ranges from the calibration vectors cut the same way.
"""

from __future__ import annotations

import numpy as np

from inferd.core import quantize
from inferd.core.outcomes import TaskResult
from inferd.core.text_options import PLAIN_INPUTS, Direction, InputOptions, TextOptions


def options_of(direction: Direction = "right", truncate: bool | None = None,
               max_tokens: int | None = None) -> InputOptions:
    """The request's encoding choices, one value every text shares (the prompt is the engine's to add, on the
    model load that runs them): the plain options when it asks for nothing the model's settings do not already do
    (so its cache entries are the plain texts')."""
    if direction == "right" and truncate is None and max_tokens is None:
        return PLAIN_INPUTS
    return InputOptions(TextOptions(direction=direction, truncate=truncate, max_tokens=max_tokens))


def vectors_of(result: TaskResult, dimensions: int | None, normalize: bool | None = None) -> np.ndarray:
    """The result's vectors (n, d): cut to ``dimensions``, unit length when the model that computed them makes
    them so (or, for TEI's ``normalize``, when asked; a model that normalises its own cannot un-normalise them)."""
    return _cut(np.vstack([np.asarray(v, dtype=np.float32) for v in result.outputs]),
                bool(result.description.normalize), dimensions, normalize)


def ranges_for(result: TaskResult, dimensions: int | None) -> np.ndarray:
    """int8/uint8 ranges of the model load that computed ``result`` (the engine measured them on it:
    ``calibrate``), at the size the request asked for."""
    assert result.calibration is not None, "the engine was asked to calibrate"
    return quantize.ranges_of(_cut(result.calibration, bool(result.description.normalize), dimensions, None))


def _cut(vectors: np.ndarray, own: bool, dimensions: int | None, normalize: bool | None) -> np.ndarray:
    if normalize is None or own:
        return quantize.shorten(vectors, dimensions, renormalise=own)
    cut = quantize.shorten(vectors, dimensions, renormalise=False)
    return quantize.unit(cut) if normalize else cut
