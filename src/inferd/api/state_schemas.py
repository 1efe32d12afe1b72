"""HTTP answers that describe the service rather than compute: the model list and info, health, and the
admin routes' model lifecycle. Documentation only, like api/answers.py: the routes build them with orjson.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ModelVersion(BaseModel):
    version: str
    role: Literal["active", "canary"]
    backend: str
    dtype: str | None = None
    quantize: str = "none"
    weight: float | None = None


class ModelCard(BaseModel):
    """One served model: ``id`` is the name a request's ``model`` names it by."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    task: str | None = "embedding"
    state: str
    ready: bool
    required: bool = True
    default: bool = False
    backend: str
    versions: list[ModelVersion]
    # Its other names (models.<name>.aliases); an alias is also listed on its own, ``alias_of`` the model's name.
    aliases: list[str] = []
    alias_of: str | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ModelInfo(BaseModel):
    role: Literal["active", "canary"]
    name: str
    version: str
    task: str = "embedding"
    state: str | None = None  # the model's lifecycle state (ready; a reload keeps it ready)
    labels: list[str] | None = None
    dimension: int | None
    max_seq_length: int | None
    device: str
    dtype: str | None
    pooling: str | None
    normalize: bool | None
    load_seconds: float
    weight: float | None
    backend: str = "torch"
    quantize: str = "none"
    # How the forward pass runs: dtype reason, export cache entry, the accuracy gate's figures.
    backend_info: dict[str, Any] | None = None
    # The runtime in one word (openvino-bfloat16, torch-float32), as each answer's X-Inferd-Runtime header says.
    runtime: str | None = None
    # backend auto (the active slot): what serves, and each other candidate's verdict and reason.
    auto: dict[str, Any] | None = None
    # Embedding models: the smaller sizes ``dimensions`` may ask for (a list, or "any"), and the prompts of
    # config_sentence_transformers.json.
    matryoshka_dimensions: list[int] | Literal["any"] | None = None
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None
    # The similarity its vectors are made for (config_sentence_transformers.json; cosine when it names none).
    similarity_fn_name: str | None = None
    # An embedding model's outputs: dense, sparse, multivector (POST /v1/encode's ``outputs``).
    outputs: list[str] | None = None


class Info(BaseModel):
    inferd_version: str
    state: str
    models: list[ModelInfo]
    task: str | None = None
    name: str | None = None
    version: str | None = None
    dimension: int | None = None
    max_seq_length: int | None = None
    device: str | None = None
    dtype: str | None = None
    backend: str | None = None
    quantize: str | None = None
    runtime: str | None = None
    auto: dict[str, Any] | None = None
    # text-embeddings-inference's fields (router/src/lib.rs Info), which its clients read, for the default model.
    model_id: str | None = None
    model_sha: str | None = None
    model_dtype: str | None = None
    served_model_name: str | None = None
    model_type: dict[str, dict[str, Any]] | None = None
    max_concurrent_requests: int | None = None
    max_input_length: int | None = None
    max_batch_tokens: int | None = None
    max_batch_requests: int | None = None
    max_client_batch_size: int | None = None
    auto_truncate: bool | None = None
    tokenization_workers: int | None = None
    sha: str | None = None
    docker_label: str | None = None


class Health(BaseModel):
    """Readiness and liveness; 503 carries the same shape (a state, never a cause: that is in the log)."""

    status: Literal["ready", "loading", "failed", "draining", "alive", "dead"]
    model: str | None = None
    version: str | None = None
    loaded: bool | None = None
    reason: str | None = None
    uptime_s: float | None = None
    # With several models: each one's status (the top-level one is the required models' together).
    models: dict[str, str] | None = None


class SlotInfo(BaseModel):
    model: str | None = None  # the served model's name (as requests name it)
    name: str
    version: str
    path: str
    task: str | None = None
    dimension: int | None
    load_seconds: float


class SlotState(SlotInfo):
    role: Literal["active", "canary"]
    in_use: int


class ShadowSlot(SlotInfo):
    in_use: int
    weight: float


class AdminModel(BaseModel):
    name: str
    task: str | None = None
    required: bool = True
    state: str
    switches: int
    canary_weight: float
    reason: str | None = None
    queue_depth: int = 0
    loading: dict[str, Any] | None = Field(None, description="the model change loading now (action, stage, seconds), "
                                                             "which POST /admin/models/reload/cancel abandons")
    slots: list[SlotState]
    shadow: ShadowSlot | None = Field(None, description="the shadow candidate (POST /admin/models/shadow), if any")


class AdminModels(BaseModel):
    """The default model's (or ``?model=``'s) lifecycle at the top level, every model's in ``models``."""

    model: str | None = None
    state: str | None
    switches: int | None
    canary_weight: float | None
    slots: list[SlotState] | None
    reason: str | None = Field(None, description="why the last load failed (paths included: admin only)")
    models: list[AdminModel] = []
    worker_error: str | None = Field(None, description="why the inference worker stopped, if it did")


class ModelChange(BaseModel):
    status: Literal["switched", "canary", "promoted", "rolled_back"]
    active: SlotInfo | None = None
    canary: SlotInfo | None = None
    weight: float | None = None
    switches: int | None = None
