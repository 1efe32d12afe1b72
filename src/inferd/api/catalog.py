"""What is served: ``/v1/models`` (OpenAI's list, with each model's task, readiness and versions) and ``/info``
(inferd's description of every served load, with the fields text-embeddings-inference's clients read).

A tenant whose ``models`` restrict it sees only those (their aliases too): what it may not call is none of its
business, and naming it would tell one tenant what another is served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from inferd import __version__
from inferd.api.answers import responses
from inferd.api.bodies import json_response
from inferd.api.services import Services, inference_auth, services
from inferd.api.state_schemas import Info, ModelList
from inferd.core.description import ModelDescription
from inferd.core.registry import ServedModel
from inferd.core.tasks.kinds import CLASSIFICATION, EMBEDDING, RERANK, task_of
from inferd.core.tasks.task import Task
from inferd.core.tenants import current_tenant
from inferd.settings import Settings

# What is served: the inference keys' business, as the inference routes.
catalog_router = APIRouter(dependencies=[Depends(inference_auth)])


def visible(request: Request) -> list[ServedModel]:
    """The served models the request's tenant may call (every one on an open server or to an unrestricted tenant),
    in the registry's order."""
    tenant = current_tenant.get()
    allowed = set(tenant.rules.models) if tenant is not None else set()
    served = list(services(request).registry)
    if not allowed:
        return served
    # By served name: a tenant's models are kept by their own names, an alias it named included (core/tenants.py).
    return [m for m in served if m.name in allowed]


def _default(request: Request, shown: list[ServedModel]) -> ServedModel | None:
    """The model /info's top-level fields describe: the server's default, or the first the tenant may call."""
    default = services(request).registry.first()
    return default if default in shown else (shown[0] if shown else None)


@catalog_router.get("/v1/models", responses=responses(ModelList, 401))
async def models(request: Request) -> Response:
    """Every served model by the name clients send as ``model``, with its task, readiness and versions."""
    s = services(request)
    data = []
    for served in visible(request):
        manager = served.manager
        versions = [{"version": slot.version, "role": role, "backend": slot.description.backend,
                     "dtype": slot.description.dtype, "quantize": slot.description.quantize,
                     "weight": manager.canary_weight if role == "canary" else None}
                    for role, slot in manager.slots()]
        data.append({"id": served.name, "object": "model", "created": int(s.started_at), "owned_by": "inferd",
                     "task": served.task, "state": manager.state, "ready": manager.state == "ready",
                     "required": served.required, "default": s.registry.default_for(served.task) is served,
                     "backend": versions[0]["backend"] if versions else served.settings.model.backend,
                     "versions": versions, "aliases": list(served.entry.aliases),
                     # Batches of this model that run at once, and each one's intra-op threads (core/instances.py).
                     "instances": served.settings.model.instances,
                     "threads_per_instance": served.settings.model.threads})
        # An alias is a model id of its own to OpenAI's clients (they look a name up in this list).
        data += [{**data[-1], "id": alias, "aliases": [], "alias_of": served.name} for alias in served.entry.aliases]
    return json_response({"object": "list", "data": data})


@catalog_router.get("/info", responses=responses(Info, 401))
async def info(request: Request) -> Response:
    # What is served, on which device, with which limits: as much the inference keys' business as /v1/models
    # (the router checks them). ``models`` holds every served slot of every model; the top-level fields are the
    # default model's active slot (a single-model server's).
    shown = visible(request)
    default = _default(request, shown)
    state = default.manager.state if default is not None else "not_loaded"
    out: dict[str, Any] = {"inferd_version": __version__, "state": state, "models": []}
    ordered = sorted(shown, key=lambda m: m is not default)
    for served in ordered:
        manager = served.manager
        for role, slot in manager.slots():
            out["models"].append(_slot_info(slot.description, role,
                                            manager.canary_weight if role == "canary" else None, manager.state))
            if role == "active" and manager.auto is not None:
                # backend auto: what serves, and why each other candidate was refused or skipped.
                out["models"][-1]["auto"] = manager.auto.describe()
    if out["models"] and out["models"][0]["name"] == (default.name if default else None):
        out.update({k: out["models"][0][k] for k in ("task", "name", "version", "dimension", "max_seq_length",
                                                     "device", "dtype", "backend", "quantize", "runtime")})
        if "auto" in out["models"][0]:
            out["auto"] = out["models"][0]["auto"]
    # The fields text-embeddings-inference's clients read (model_id, model_type, ...).
    out.update(tei_info(services(request), default))
    return json_response(out)


def _slot_info(d: ModelDescription, role: str, weight: float | None, state: str) -> dict[str, Any]:
    """A slot as /info shows it: its description, built at load (core/description.py), and its role now."""
    return {"role": role, "state": state, "weight": weight, **d.wire()}


def tei_info(s: Services, served: ServedModel | None) -> dict[str, Any]:
    """The /info fields text-embeddings-inference's clients read (router/src/lib.rs Info; tei-client requires
    each key), for ``served`` (the default model, or the first the tenant may call): ``model_type`` is
    ``{"embedding": {"pooling"}}``, ``{"classifier": {"id2label", "label2id"}}`` or ``{"reranker": ...}``. TEI's
    own ``version`` (its router's) is not given: inferd's ``version`` is the model's."""
    settings = served.settings if served is not None else s.settings
    slots = served.manager.slots() if served is not None else []
    d = slots[0][1].description if slots else None
    name = (served.task if served is not None else None) or (d.task if d else None)
    task = task_of(name) if name else EMBEDDING
    # A task TEI has no name for (a plug-in's) shows its labels as a reranker's.
    model_type = _TEI_MODEL_TYPES.get(task, _TEI_MODEL_TYPES[RERANK])(d, settings)
    return {
        "model_id": d.name if d else settings.model.name, "model_sha": None,
        "model_dtype": (d.dtype if d else None) or settings.model.dtype,
        "served_model_name": served.name if served else None,
        "model_type": model_type, "max_concurrent_requests": settings.server.limit_concurrency,
        "max_input_length": d.max_seq_length if d else None, "max_batch_tokens": settings.batching.max_batch_tokens,
        "max_batch_requests": settings.batching.max_batch_size,
        "max_client_batch_size": settings.limits.max_items_per_request, "auto_truncate": settings.model.truncate,
        "tokenization_workers": settings.limits.preprocess_concurrency, "sha": None, "docker_label": None}


def _pooled(d: ModelDescription | None, settings: Settings) -> dict[str, Any]:
    return {"embedding": {"pooling": (d.pooling if d else None) or settings.model.pooling or "mean"}}


def _labelled(key: str) -> Callable[[ModelDescription | None, Settings], dict[str, Any]]:
    def model_type(d: ModelDescription | None, settings: Settings) -> dict[str, Any]:
        labels = (d.labels if d else None) or ("LABEL_0",)
        return {key: {"id2label": {str(i): label for i, label in enumerate(labels)},
                      "label2id": {label: i for i, label in enumerate(labels)}}}
    return model_type


# TEI's model_type of each task's model (keyed by the task object), built from its description (None: no load yet).
_TEI_MODEL_TYPES: dict[Task, Callable[[ModelDescription | None, Settings], dict[str, Any]]] = {
    EMBEDDING: _pooled, CLASSIFICATION: _labelled("classifier"), RERANK: _labelled("reranker")}
