"""What the embedding wire APIs share (OpenAI's /v1/embeddings, TEI's /embed and /similarity, Cohere's embed):
a request's encoding choices as the texts the engine takes, and the answer's size and precision, shaped by the
description of the model load that computed the result (core/work.py TaskResult), never by a slot looked up again.

- **Prompts** are chosen by the route (core/prompts.py Prompt: a name, Cohere's input type, or the default) and
  resolved by the engine on the slot that runs the request: a canary encodes with its own prompts.
- **Sizes**: the engine refuses a size the model does not allow (core/admission.py wrong_dimensions); the
  vectors come back whole and are cut here (core/quantize.py), so the result cache keeps full vectors and a
  text's entry serves every size.
- **int8 / uint8** need per-component ranges: the engine measures them once per model load on the calibration
  texts, on the very slot that answered, and hands them back with the result (``calibrate``); each size gets its
  ranges from the calibration vectors cut the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson
from fastapi import Request

from inferd.api.errors import APIError, engine_refusal
from inferd.api.services import services
from inferd.core import quantize
from inferd.core.admission import not_ready
from inferd.core.manager import ModelNotReady
from inferd.core.preprocess import Direction, TextInput
from inferd.core.registry import ModelNotFound, ServedModel
from inferd.core.work import TaskResult


async def describe(request: Request, model: str | None, task: str | None = "embedding"
                   ) -> tuple[ServedModel, dict]:
    """The model a request names (or its task's default), loaded, and the description of the slot it pins
    (else the active one): its size, normalisation, prompts and Matryoshka sizes."""
    s = services(request)
    try:
        served, pin = s.registry.resolve(model, task)
    except ModelNotFound as exc:
        if not exc.task_served:
            raise APIError(404, f"{request.url.path} serves the {task} task; {exc.message}", "wrong_task") from None
        raise APIError(404, exc.message, "model_not_found", "model") from None
    try:
        if served.settings.model.load_mode == "lazy":
            await served.manager.ensure_loaded()
        slots = served.manager.slots()
        if not slots:
            raise ModelNotReady(served.manager.state)
    except ModelNotReady as exc:
        # The engine's own refusal (503 model_failed or model_not_ready, its Retry-After), naming the model.
        raise engine_refusal(not_ready(exc, served.name), "model", False) from None
    version = (pin.partition("@")[2] or pin) if pin else None
    info = next((slot.info for _, slot in slots if slot.version == version), slots[0][1].info)
    return served, info


def prompt_of(info: Mapping[str, Any], prompt_name: str | None, field: str = "prompt_name") -> str:
    """The prompt text a request's ``prompt_name`` names (None: the model's default prompt, if any).

    An unknown name is refused with the names there are, worded as text-embeddings-inference words it
    (``Available prompts: [...]``: its clients read the list from the message)."""
    prompts: dict[str, str] = dict(info.get("prompts") or {})
    if prompt_name is None:
        default = info.get("default_prompt_name")
        return prompts.get(default, "") if default else ""
    if prompt_name not in prompts:
        if not prompts:
            raise APIError(422, f"{field}: {prompt_name!r} was asked, but this model has no prompts "
                           "(config_sentence_transformers.json)", "unknown_prompt", field)
        raise APIError(422, f"{field}: {prompt_name!r} is not one of this model's prompts. Available prompts: "
                       f"{orjson.dumps(sorted(prompts)).decode()}", "unknown_prompt", field)
    return prompts[prompt_name]


def inputs_of(texts: Sequence[str], prompt: str = "", direction: Direction = "right", truncate: bool | None = None,
              max_tokens: int | None = None) -> list[Any]:
    """The engine's inputs: plain texts when the request asks for nothing the model's settings do not already
    do (so their cache entries are the plain texts'), else TextInputs carrying the request's choices."""
    if not prompt and direction == "right" and truncate is None and max_tokens is None:
        return list(texts)
    return [TextInput(t, prompt, direction, truncate, max_tokens) for t in texts]


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


def shaped(result: TaskResult, info: Mapping[str, Any], dimensions: int | None, normalize: bool | None = None
           ) -> np.ndarray:
    """vectors_of by a description looked up by the route (TEI's routes, until they read the result's)."""
    return _cut(np.vstack([np.asarray(v, dtype=np.float32) for v in result.outputs]), bool(info.get("normalize")),
                dimensions, normalize)


def require_unnormalised_allowed(info: Mapping[str, Any], normalize: bool) -> None:
    if not normalize and info.get("normalize"):
        raise APIError(422, "normalize: false is not available on this model: its own configuration normalises "
                       "its vectors (a Normalize module, or model.normalize: true)", "invalid_value", "normalize")


