"""TEI's /predict (``{"inputs": ...}``): each input's labels by score, from the classifier (texts) or the
reranker (``[query, document]`` pairs). Not a route module: ``POST /predict`` is inferd's own route too
(api/inferd_routes.py asks ``is_tei_predict`` first), and TEI's ``POST /`` on a classifier answers it
(api/tei.py)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from starlette.responses import Response

from inferd.api import vectors
from inferd.api.bodies import json_response
from inferd.api.client_schemas import (
    TEIPredictRequest,
    direction,
)
from inferd.api.engine_call import ask_engine, build, read_request
from inferd.api.errors import Names, refusal
from inferd.api.rerank_chunking import chunking_of, with_span
from inferd.api.services import services
from inferd.api.tei_shape import tei_errors, tei_pairs
from inferd.core.errors import Kind
from inferd.core.outcomes import TaskResult
from inferd.core.request import InferenceRequest
from inferd.core.tasks.kinds import CLASSIFICATION, RERANK
from inferd.core.tasks.task import Task

# -- /predict in TEI's shape -------------------------------------------------------------------------------


async def is_tei_predict(request: Request) -> bool:
    """A /predict body in TEI's shape: a JSON object with ``inputs`` and without ``texts`` (inferd's own)."""
    raw = await request.body()
    if b'"inputs"' not in raw:
        return False  # the common case, decided without parsing twice
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False  # inferd's route answers the malformed body
    return isinstance(data, dict) and "inputs" in data and "texts" not in data


def _sequences(inputs: Any) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's PredictInput: a text, a pair ``[a, b]`` (or ``[a]``), or a batch ``[[a], [a, b], ...]``.
    Returns the sequences and whether it was a batch."""
    def one(value: Any, where: str) -> str | tuple[str, str]:
        if isinstance(value, list) and len(value) in (1, 2) and all(isinstance(v, str) for v in value):
            return value[0] if len(value) == 1 else (value[0], value[1])
        raise refusal(Kind.INVALID_INPUT, f"{where}: must be [text] or [text, text]", "invalid_type", where)

    if isinstance(inputs, str):
        return [inputs], False
    if not isinstance(inputs, list) or not inputs:
        raise refusal(Kind.INVALID_INPUT, "inputs: must be a text, a pair of texts, or a batch of texts and pairs",
                      "invalid_type", "inputs")
    if isinstance(inputs[0], str):
        return [one(inputs, "inputs")], False
    return [one(v, f"inputs[{i}]") for i, v in enumerate(inputs)], True


# The tasks TEI's /predict serves (a classifier's texts, a reranker's pairs: each task object says which it takes),
# each with why a body of the other kind does not fit a server that serves only it.
_PREDICTED: dict[Task, str] = {
    CLASSIFICATION: "inputs: this server's classifier takes single texts, not pairs",
    RERANK: "inputs: a rerank model scores [query, document] pairs, not single texts"}


def _predict_task(request: Request, sequences: list[Any]) -> Task:
    """The task TEI's /predict runs for what was sent: texts are a classifier's, ``[query, document]`` pairs a
    reranker's (TEI serves one model and hands it either; here each goes to its task's default model)."""
    pairs = [not isinstance(s, str) for s in sequences]
    if any(pairs) and not all(pairs):
        raise refusal(Kind.INVALID_INPUT, "inputs: a batch is texts (for a classifier) or [query, document] pairs "
                      "(for a reranker), not both", "invalid_type", "inputs")
    task = next(t for t in _PREDICTED if t.takes_pairs == pairs[0])
    tasks = set(services(request).registry.tasks())
    if task.name in tasks or None in tasks:
        return task
    for other, why in _PREDICTED.items():
        if other.name in tasks:
            raise refusal(Kind.INVALID_INPUT, why, "invalid_type", "inputs")
    served = ", ".join(sorted(t for t in tasks if t)) or "no"
    raise refusal(Kind.WRONG_TASK, f"/predict with inputs serves classification and rerank models; this server "
                  f"serves {served} models (their routes: /embed, /v1/embeddings)")


@tei_errors
async def tei_predict(request: Request) -> Response:
    """TEI's predict: each input's labels by score, best first (a classifier's probabilities for texts, or a
    reranker's pair score under its ``LABEL_0``-style label for pairs)."""
    body, engine_request = await read_request(request, TEIPredictRequest, lambda b: _request(request, b))
    names = _names(body)
    result = await ask_engine(request, engine_request, names)
    rows = scored(body, result) if engine_request.pairs else classified(body, result)
    params = body.parameters
    if params is not None and params.top_k is not None:
        rows = [r[: params.top_k] for r in rows]
    return json_response(rows if names.listed else rows[0])


def _applied(params: Any, own: str, raw: bool) -> str | None:
    """The field that asks for raw logits (raw_scores, or function_to_apply "none"), if one does; refuses
    another activation than the model's own."""
    wanted = params.function_to_apply if params is not None else None
    if wanted is not None and wanted != "none" and wanted != own:
        raise refusal(Kind.INVALID_INPUT, f"parameters.function_to_apply: this model applies {own}; {wanted} was "
                      "asked", "invalid_value", "parameters.function_to_apply")
    if raw:
        return "raw_scores"
    return "parameters.function_to_apply" if wanted == "none" else None


def _names(body: TEIPredictRequest) -> Names:
    batch = isinstance(body.inputs, list) and bool(body.inputs) and not isinstance(body.inputs[0], str)
    return Names("inputs", batch, query="inputs[{i}][0]" if batch else "inputs[0]")


def _request(request: Request, body: TEIPredictRequest) -> InferenceRequest:
    sequences, _ = _sequences(body.inputs)
    task = _predict_task(request, sequences)
    if task.takes_pairs:
        inputs: list[Any] = [pair for query, document in sequences for pair in tei_pairs(query, [document])]
    else:
        inputs = list(sequences)
    return build(request, inputs, _names(body), task=task.name, priority=body.priority, timeout_ms=body.timeout_ms,
                 chunking=chunking_of(body.chunking),
                 text_options=vectors.options_of(direction(body.truncation_direction), body.truncate))


def classified(body: TEIPredictRequest, result: TaskResult) -> list[list[dict[str, Any]]]:
    # The activation is the answering model's (a canary's own): checked on its description, after the run.
    own = "sigmoid" if result.description.multi_label else "softmax"
    asked = _applied(body.parameters, own, body.raw_scores)
    if asked is not None:
        # The task computes probabilities only: a softmax's logits cannot be recovered from them.
        raise refusal(Kind.INVALID_INPUT, f"{asked}: asks for logits; a classifier answers probabilities here "
                      f"({own}: send function_to_apply {own} or leave it out)", "invalid_value", asked)
    labels = list(result.description.labels or ())
    return [sorted(({"score": float(p), "label": labels[i]} for i, p in enumerate(probs)),
                   key=lambda r: -r["score"]) for probs in result.outputs]


def scored(body: TEIPredictRequest, result: TaskResult) -> list[list[dict[str, Any]]]:
    raw = _applied(body.parameters, "sigmoid", body.raw_scores) is not None
    label = (result.description.labels or ("LABEL_0",))[0]
    return [[with_span({"score": float(o[1] if raw else o[0]), "label": label}, o)] for o in result.outputs]
