"""The Open Inference Protocol's models, whatever carries it (HTTP: api/oip.py; gRPC: grpc/oip.py): each task's
tensors (``SIGNATURES``, keyed by the task object), the model a request names (one the caller may call), and an
infer request planned (the inputs and options of its one engine request) and answered (the output tensors asked).

An embedding model takes ``text`` (BYTES) and gives ``embedding`` (FP32, one row per text); a reranker takes
``query`` (one BYTES element) and ``documents`` (BYTES) and gives ``score`` (FP32, one per document, in the
documents' order); a classifier takes ``text`` and gives ``label`` (BYTES), ``score`` (FP32: the label's
probability) and ``probabilities`` (FP32, one row per text, in the order of the model's labels). Triton's request
parameters ``priority`` (0 the default, 1 the highest level, each level above one step lower) and ``timeout``
(microseconds) become the request's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request

from inferd.api import vectors
from inferd.api.catalog import visible
from inferd.api.errors import Names, refusal
from inferd.api.oip_tensors import InferBody, OIPError, OutputTensor, TensorSpec
from inferd.api.services import services
from inferd.core.description import ModelDescription
from inferd.core.errors import Kind, excerpt
from inferd.core.outcomes import TaskResult
from inferd.core.registry import ServedModel
from inferd.core.tasks.kinds import CLASSIFICATION, EMBEDDING, RERANK, task_of
from inferd.core.tasks.task import Task

# -- each task's tensors -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Signature:
    """A task's tensors: the inputs it takes, the outputs it gives (by the model's description: a dimension, a
    count of labels), the engine's inputs made of the texts sent, and the output tensors of a result."""

    inputs: tuple[TensorSpec, ...]
    outputs: Callable[[ModelDescription | None], tuple[TensorSpec, ...]]
    engine_inputs: Callable[[dict[str, list[str]]], list[Any]]
    answer: Callable[[TaskResult], list[OutputTensor]]
    names: Names  # how the engine's refusals name the inputs


def _texts(inputs: dict[str, list[str]]) -> list[Any]:
    return inputs["text"]


def _pairs(inputs: dict[str, list[str]]) -> list[Any]:
    if len(inputs["query"]) != 1:
        raise OIPError(f"input 'query': holds one text (shape [1]); {len(inputs['query'])} were sent")
    query = inputs["query"][0]
    return [(query, d) for d in inputs["documents"]]


def _embedding_outputs(d: ModelDescription | None) -> tuple[TensorSpec, ...]:
    return (TensorSpec("embedding", "FP32", (-1, (d.dimension if d else None) or -1)),)


def _embedded(result: TaskResult) -> list[OutputTensor]:
    return [OutputTensor("embedding", "FP32", vectors.vectors_of(result, None))]


def _scored(result: TaskResult) -> list[OutputTensor]:
    return [OutputTensor("score", "FP32", np.array([o[0] for o in result.outputs], dtype=np.float32))]


def _labels_count(d: ModelDescription | None) -> int:
    return len(d.labels) if d is not None and d.labels else -1


def _classification_outputs(d: ModelDescription | None) -> tuple[TensorSpec, ...]:
    return (TensorSpec("label", "BYTES", (-1,)), TensorSpec("score", "FP32", (-1,)),
            TensorSpec("probabilities", "FP32", (-1, _labels_count(d))))


def _classified(result: TaskResult) -> list[OutputTensor]:
    labels = list(result.description.labels or ())
    probs = np.vstack([np.asarray(p, dtype=np.float32) for p in result.outputs])
    best = probs.argmax(axis=1)
    return [OutputTensor("label", "BYTES", [labels[i] for i in best]),
            OutputTensor("score", "FP32", probs[np.arange(len(best)), best]),
            OutputTensor("probabilities", "FP32", probs)]


_TEXT = TensorSpec("text", "BYTES", (-1,))
# The engine's options by the request's parameters they come from.
_PARAMETERS = {"priority": "parameters.priority", "timeout_ms": "parameters.timeout"}
SIGNATURES: dict[Task, Signature] = {
    EMBEDDING: Signature((_TEXT,), _embedding_outputs, _texts, _embedded, Names("text", fields=_PARAMETERS)),
    RERANK: Signature((TensorSpec("query", "BYTES", (1,)), TensorSpec("documents", "BYTES", (-1,))),
                      lambda d: (TensorSpec("score", "FP32", (-1,)),), _pairs, _scored,
                      Names("documents", query="query", fields=_PARAMETERS)),
    CLASSIFICATION: Signature((_TEXT,), _classification_outputs, _texts, _classified,
                              Names("text", fields=_PARAMETERS)),
}


# -- which model -------------------------------------------------------------------------------------------


def served_model(request: Request, name: str) -> ServedModel:
    """The model a path names, if the caller may call it (a tenant restricted to some sees only those)."""
    served = services(request).registry.get(name)
    shown = visible(request)
    if served is None or served not in shown:
        raise refusal(Kind.MODEL_NOT_FOUND, f"model {excerpt(name)!r} is not served here; the models served: "
                      f"{', '.join(m.name for m in shown) or 'none'}", param="model")
    return served


def signature_of(served: ServedModel) -> tuple[Task, Signature]:
    # A model whose task is known only once it loads is described as an embedding model until then.
    task = task_of(served.task) if served.task else EMBEDDING
    signature = SIGNATURES.get(task)
    if signature is None:
        raise OIPError(f"model {served.name!r} serves the {task.name} task, which has no tensors in the Open "
                       "Inference Protocol here", status=404)
    return task, signature


def description_of(served: ServedModel) -> ModelDescription | None:
    slots = served.manager.slots()
    return slots[0][1].description if slots else None


def versions_of(served: ServedModel) -> list[str]:
    return [slot.version for _, slot in served.manager.slots()]


def check_version(served: ServedModel, version: str | None) -> None:
    if version is not None and version not in versions_of(served):
        raise refusal(Kind.MODEL_NOT_FOUND, f"model {served.name!r} serves version "
                      f"{' and '.join(versions_of(served)) or 'none yet'}, not {excerpt(version)!r}", param="model")


# -- infer -------------------------------------------------------------------------------------------------


def _options(body: InferBody) -> dict[str, Any]:
    """Triton's request parameters as the engine's options: ``priority`` levels (1 the highest, 0 the default)
    and ``timeout`` in microseconds."""
    out: dict[str, Any] = {}
    priority = body.parameters.get("priority")
    if priority is not None:
        if type(priority) is not int or priority < 0:
            raise OIPError(f"parameters.priority: must be a level, an integer from 0 (the default) up, not "
                           f"{excerpt(str(priority))!r}")
        out["priority"] = -max(0, priority - 1)
    timeout = body.parameters.get("timeout")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise OIPError(f"parameters.timeout: must be microseconds, not {excerpt(str(timeout))!r}")
        out["timeout_ms"] = timeout / 1000
    return out


def _chosen(signature: Signature, body: InferBody) -> list[str]:
    """The inputs sent are exactly the task's; the outputs asked for, the task's (none asked: every one)."""
    wanted = [t.name for t in signature.inputs]
    missing = [n for n in wanted if n not in body.inputs]
    extra = [n for n in body.inputs if n not in wanted]
    if missing or extra:
        what = f"missing {missing}" if missing else f"unknown {[excerpt(n) for n in extra]}"
        raise OIPError(f"inputs: this model takes {wanted}; {what}")
    given = [t.name for t in signature.outputs(None)]
    if body.outputs is None:
        return given
    unknown = [n for n in body.outputs if n not in given]
    if unknown:
        raise OIPError(f"outputs: this model gives {given}; unknown {[excerpt(n) for n in unknown]}")
    return list(body.outputs)


@dataclass(frozen=True, slots=True)
class Plan:
    """An infer request planned: the model and its task's tensors, the outputs asked for (in order), and the
    engine request's inputs and options (``build``'s, api/engine_call.py's or grpc/call.py's)."""

    served: ServedModel
    signature: Signature
    outputs: list[str]
    inputs: list[Any]
    options: dict[str, Any]
    body: InferBody

    def answer(self, result: TaskResult) -> tuple[dict[str, Any], list[tuple[OutputTensor, bool]]]:
        """The response's head and its output tensors, each with whether it is asked for in binary."""
        tensors = {t.name: t for t in self.signature.answer(result)}
        binary = self.body.outputs or {}
        chosen = [(tensors[n], binary.get(n, self.body.binary_default)) for n in self.outputs]
        head: dict[str, Any] = {"model_name": self.served.name, "model_version": result.version}
        if self.body.id is not None:
            head["id"] = self.body.id
        return head, chosen


def plan(request: Request, body: InferBody, name: str, version: str | None) -> Plan:
    """The engine request an infer request makes of the model ``name`` (``version`` pinned), every rule of the
    protocol checked (raises OIPError, or APIError for a model not served)."""
    served = served_model(request, name)
    task, signature = signature_of(served)
    outputs = _chosen(signature, body)
    model = served.name if version is None else f"{served.name}@{version}"
    return Plan(served, signature, outputs, signature.engine_inputs(body.inputs),
                {"task": task.name, "model": model, **_options(body)}, body)
