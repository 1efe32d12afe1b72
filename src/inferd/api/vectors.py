"""What the embedding wire APIs share (OpenAI's /v1/embeddings, TEI's /embed and /similarity, Cohere's embed):
the description of the model a request names, its prompts, a request's encoding choices as the texts the
engine takes, and the answer's size and precision.

- **Prompts** are resolved here, from the model's description (core/tasks/embedding.py reads them from its
  folder), and prepended to each text: what is tokenised, counted and cached is ``prompt + text``, as
  ``SentenceTransformer.encode(prompt_name=...)`` tokenises it. No prompt named: the model's
  ``default_prompt_name``'s, as sentence-transformers does.
- **Sizes**: the engine refuses a size the model does not allow (core/admission.py wrong_dimensions); the
  vectors come back whole and are cut here (core/quantize.py), so the result cache keeps full vectors and a
  text's entry serves every size.
- **int8 / uint8** need per-component ranges: measured once per model load on the calibration texts
  (``model.calibration_file``, else a built-in multilingual set), embedded as they are (no prompt) through the
  engine on the very slot that answered, the first time a request asks; kept per load, as full vectors, so
  each size gets its ranges from the calibration vectors cut the same way.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson
from fastapi import Request

from inferd.api.errors import APIError, engine_refusal
from inferd.api.services import services
from inferd.core import quantize
from inferd.core.admission import not_ready, wrong_dimensions
from inferd.core.errors import EngineError
from inferd.core.manager import ModelNotReady
from inferd.core.preprocess import Direction, TextInput
from inferd.core.registry import ModelNotFound, ServedModel
from inferd.core.work import TaskResult

# Cohere's input types, and the prompt names each is looked up by (the first the model has), unless the
# operator's model.input_type_prompts names one.
INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
# Calibration vectors kept (one entry per model load that was asked for int8/uint8).
_CALIBRATIONS_KEPT = 8


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


def input_type_prompt(served: ServedModel, info: Mapping[str, Any], input_type: str | None) -> str:
    """The prompt for Cohere's ``input_type``: ``model.input_type_prompts`` names a prompt per input type, else
    the first of INPUT_TYPE_PROMPTS' names the model has. An input type with no prompt encodes the text
    alone (it says what the text is, so the default prompt, made for another kind of text, is not applied);
    no input type: the model's default prompt."""
    if input_type is None:
        return prompt_of(info, None)
    prompts: dict[str, str] = dict(info.get("prompts") or {})
    mapping = served.settings.model.input_type_prompts
    if input_type in mapping:
        return prompt_of(info, mapping[input_type], "input_type")
    name = next((n for n in INPUT_TYPE_PROMPTS.get(input_type, ()) if n in prompts), None)
    return prompts[name] if name is not None else ""


def inputs_of(texts: Sequence[str], prompt: str = "", direction: Direction = "right", truncate: bool | None = None,
              max_tokens: int | None = None) -> list[Any]:
    """The engine's inputs: plain texts when the request asks for nothing the model's settings do not already
    do (so their cache entries are the plain texts'), else TextInputs carrying the request's choices."""
    if not prompt and direction == "right" and truncate is None and max_tokens is None:
        return list(texts)
    return [TextInput(t, prompt, direction, truncate, max_tokens) for t in texts]


def check_dimensions(info: Mapping[str, Any], dimensions: int | None, field: str) -> None:
    """A size the model does not allow, named by the route's own field (the engine checks it again, on the
    slot that runs the request)."""
    if dimensions is None:
        return
    from_engine = wrong_size(info, dimensions)
    if from_engine is not None:
        raise APIError(422, f"{field}: {from_engine}", "invalid_value", field)


def wrong_size(info: Mapping[str, Any], dimensions: int) -> str | None:
    """The engine's rule (core/admission.py), read here for the message only."""
    refusal = wrong_dimensions(info, dimensions)
    return None if refusal is None else refusal.message


def shaped(result: TaskResult, info: Mapping[str, Any], dimensions: int | None, normalize: bool | None = None
           ) -> np.ndarray:
    """The result's vectors (n, d): cut to ``dimensions``, unit length when the model's are (or, for TEI's
    ``normalize``, when asked; a model that normalises its own vectors cannot un-normalise them)."""
    vectors = np.vstack([np.asarray(v, dtype=np.float32) for v in result.outputs])
    own = bool(info.get("normalize"))
    if normalize is None or own:
        return quantize.shorten(vectors, dimensions, renormalise=own)
    cut = quantize.shorten(vectors, dimensions, renormalise=False)
    return quantize.unit(cut) if normalize else cut


def require_unnormalised_allowed(info: Mapping[str, Any], normalize: bool) -> None:
    if not normalize and info.get("normalize"):
        raise APIError(422, "normalize: false is not available on this model: its own configuration normalises "
                       "its vectors (a Normalize module, or model.normalize: true)", "invalid_value", "normalize")


# -- int8 / uint8 calibration -------------------------------------------------------------------------------


def _slot_key(request: Request, result: TaskResult) -> Any:
    served = services(request).registry.get(result.model)
    for _, slot in served.manager.slots() if served is not None else []:
        if slot.version == result.version:
            return slot.load_id
    raise APIError(503, "the model that answered was unloaded meanwhile; retry", "model_unloaded",
                   headers={"Retry-After": "1"})


def _store(request: Request) -> OrderedDict[Any, asyncio.Future]:
    state = request.app.state
    store = getattr(state, "inferd_calibrations", None)
    if store is None:
        store = OrderedDict()
        state.inferd_calibrations = store
    return store


async def ranges_for(request: Request, result: TaskResult, info: Mapping[str, Any], dimensions: int | None,
                     body: Any) -> np.ndarray:
    """int8/uint8 ranges of the model load that computed ``result``, at the size the request asked for."""
    key = _slot_key(request, result)
    store = _store(request)
    future = store.get(key)
    if future is None:
        future = asyncio.ensure_future(_calibrate(request, result, body))
        store[key] = future
        while len(store) > _CALIBRATIONS_KEPT:
            store.popitem(last=False)
    try:
        vectors = await asyncio.shield(future)
    except BaseException:
        if store.get(key) is future and future.done():
            del store[key]  # a failed calibration is tried again by the next request
        raise
    cut = shaped(TaskResult(list(vectors), [], result.model, result.version, {}), info, dimensions)
    return quantize.ranges_of(cut)


async def _calibrate(request: Request, result: TaskResult, body: Any) -> np.ndarray:
    s = services(request)
    served = s.registry.get(result.model)
    settings = served.settings if served is not None else s.settings
    limit = settings.limits.max_chars_per_text
    texts = [t[:limit] for t in quantize.calibration_texts(settings.model.calibration_file) if t.strip()]
    step = min(settings.limits.max_items_per_request, settings.batching.max_queue)
    out: list[np.ndarray] = []
    for start in range(0, len(texts), step):
        try:
            # Pinned to the load that answered the request, so the ranges are that model's.
            got = await s.engine.run(texts[start: start + step], priority=body.priority, timeout_ms=body.timeout_ms,
                                     model=f"{result.model}@{result.version}", task="embedding")
        except EngineError as exc:
            raise engine_refusal(exc, "calibration", False) from None
        if got.version != result.version:
            raise APIError(503, "the model changed while its int8 ranges were measured; retry", "model_unloaded",
                           headers={"Retry-After": "1"})
        out.extend(np.asarray(v, dtype=np.float32) for v in got.outputs)
    return np.vstack(out)
