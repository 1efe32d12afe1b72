"""HTTP bodies: the requests (validated here for shape; texts are checked by core.preprocess, the one
place for those rules) and the responses (documentation only: the routes build their answers with
orjson, so these describe them in the OpenAPI schema, and the fuzz tests hold the answers to them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

# -- requests ----------------------------------------------------------------------------------------------

_TEXT = {"type": "string", "minLength": 1}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    priority: StrictInt = Field(
        0, ge=-100, le=100,
        description="Higher runs first (ageing lifts waiting work). Values above batching.max_priority "
                    "(default 0: none may jump the queue) are refused with 422; lower ones are always allowed.")
    # Strict like priority: JSON true is not 1 ms, and "5" is not a number.
    timeout_ms: StrictFloat | None = Field(None, gt=0, le=600_000, allow_inf_nan=False,
                                           description="Deadline; a request still queued past it gets 504")


class RerankChunkingOptions(BaseModel):
    """A rerank request's ``chunking``: a document that does not fit beside the query scored piece by piece
    (docs/long-documents.md)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["max", "mean"] = Field("max", description="A split document's score: its best piece's (max) or "
                                                             "the mean of its pieces'")
    max_tokens: StrictInt | None = Field(None, gt=0, description="Tokens per piece (null: as many as fit beside "
                                         "the query)")
    overlap: StrictInt = Field(0, ge=0, description="Tokens shared by neighbouring pieces (less than max_tokens)")


_RERANK_CHUNKING = ("Score a document that does not fit beside the query piece by piece, each result naming the "
                    "span that scored (docs/long-documents.md); null: cut it")


class PredictRequest(_Body):
    """The seed's shape: ``{"texts": [...]}``."""

    # Any: a wrong item is reported by core.preprocess as "texts[i]: ..." with its own code.
    texts: list[Any] = Field(json_schema_extra={"items": _TEXT, "minItems": 1})
    model: str | None = Field(None, description="A served model's name (GET /v1/models), 'name@version' to pin "
                              "a version, or a version of the default model; none: the route's default model")
    chunking: RerankChunkingOptions | None = Field(None, description="A reranker's pairs: score a document that "
                                                   "does not fit beside its query piece by piece (null: cut it)")


class ChunkingOptions(BaseModel):
    """A request's ``chunking``: texts longer than the model's window split into pieces that fit it
    (docs/long-documents.md)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["pooled", "pieces", "late"] = Field(
        "pooled", description="pooled: one vector per text, the token-weighted mean of its pieces' (renormalised "
                              "when the model's vectors are unit length); pieces: every piece's too, with its span; "
                              "late: as pieces, each piece pooled from one pass over the window around it (late "
                              "chunking)")
    max_tokens: StrictInt | None = Field(None, gt=0, description="Tokens per piece (null: as many as the model's "
                                         "window leaves beside its special tokens and prompt)")
    overlap: StrictInt = Field(0, ge=0, description="Tokens shared by neighbouring pieces (less than max_tokens)")


_CHUNKING = "Split texts longer than the model's window into pieces (docs/long-documents.md); null: do not"



class EmbeddingsRequest(_Body):
    """OpenAI's ``POST /v1/embeddings``; ``input`` is a string or a list of strings."""

    input: Any = Field(json_schema_extra={"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]})
    model: str | None = Field(None, description="A served model's name (GET /v1/models), 'name@version' to pin "
                              "a version, or a version of the default model; none: the route's default model")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, gt=0, description="Must equal the model's dimension")
    user: str | None = None
    chunking: ChunkingOptions | None = Field(None, description=_CHUNKING)


class RerankRequest(_Body):
    """Cohere / Jina / vLLM ``POST /v1/rerank``: one query, documents to score against it."""

    query: Any = Field(json_schema_extra=_TEXT)
    documents: list[Any] = Field(json_schema_extra={"items": _TEXT, "minItems": 1})
    model: str | None = Field(None, description="A served model's name (GET /v1/models), 'name@version' to pin "
                              "a version, or a version of the default model; none: the route's default model")
    top_n: StrictInt | None = Field(None, gt=0, description="Return only the best this many")
    # Strict: "yes" and 1 are not booleans; null is the default, as the clients that send every field mean it.
    return_documents: StrictBool | None = Field(None, description="Each result's document too (null: false)")
    chunking: RerankChunkingOptions | None = Field(None, description=_RERANK_CHUNKING)


class TEIRerankRequest(_Body):
    """text-embeddings-inference's ``POST /rerank``."""

    query: Any = Field(json_schema_extra=_TEXT)
    texts: list[Any] = Field(json_schema_extra={"items": _TEXT, "minItems": 1})
    raw_scores: StrictBool = Field(False, description="The model's logits, not the activated scores")
    return_text: StrictBool = False
    truncate: StrictBool | None = Field(None, description="Cut a pair over the model's limit (null: "
                                        "model.truncate); false refuses it with 422")
    truncation_direction: Literal["left", "right", "Left", "Right"] = Field(
        "right", description="The side of the document an over-long pair loses (the query is kept): right its "
                             "end, left its start")
    # Not TEI's (a TEI server serves one model): inferd's, to name one of several; none = the rerank default.
    model: str | None = Field(None, description="A served rerank model's name (GET /v1/models); none: the "
                              "default rerank model")
    chunking: RerankChunkingOptions | None = Field(None, description=_RERANK_CHUNKING)


class ClassifyRequest(_Body):
    """vLLM's ``POST /v1/classify``: a text or a list of texts."""

    input: Any = Field(json_schema_extra={"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]})
    model: str | None = Field(None, description="A served model's name (GET /v1/models), 'name@version' to pin "
                              "a version, or a version of the default model; none: the route's default model")
    user: str | None = None


class EncodeRequest(_Body):
    """inferd's ``POST /v1/encode``: any of an embedding model's outputs, from one forward pass."""

    input: Any = Field(json_schema_extra={"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]})
    model: str | None = Field(None, description="A served embedding model's name (GET /v1/models); none: the "
                              "default embedding model")
    outputs: list[Literal["dense", "sparse", "multivector"]] = Field(
        ["dense"], min_length=1, max_length=3,
        description="What each text gets: its dense vector, its sparse weights ({indices, values}), its token "
                    "vectors; the model must give each (a refusal names those it gives)")
    encoding_format: Literal["float", "base64", "binary", "ubinary"] = Field(
        "float", description="Of the dense vector and each token vector: floats, base64 of little-endian float32, "
                             "or packed sign bits (binary int8, ubinary uint8)")
    return_tokens: StrictBool = Field(False, description="Each sparse weight's token text too (sparse.tokens)")
    input_type: Literal["query", "document"] = Field(
        "document", description="A late-interaction model (ColBERT) encodes a query with its query marker and "
                                "expansion; other models encode both alike")
    truncate: StrictBool | None = Field(None, description="Cut texts over the model's limit (null: model.truncate); "
                                        "false refuses them with 422")
    truncation_direction: Literal["left", "right"] = "right"
    prompt_name: str | None = Field(None, description="A prompt of the model's config_sentence_transformers.json "
                                    "(null: its default_prompt_name's, if any)")
    chunking: ChunkingOptions | None = Field(None, description=_CHUNKING)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body (the routes read it themselves: see read_body)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": model.model_json_schema()}}}}


# -- responses ---------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None


class ErrorResponse(BaseModel):
    """The one error shape, every status."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int


class PredictResponse(BaseModel):
    results: list[Any] = Field(description="embedding: a vector per text; rerank: a score per [query, document] "
                                           "pair; classification: {label, probs} per text")
    model: str = Field(description="name@version that computed every result")
    usage: Usage


class EmbeddingItem(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingsUsage(Usage):
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingsUsage


class SparseOutput(BaseModel):
    indices: list[int] = Field(description="Vocabulary ids, ascending")
    values: list[float] = Field(description="Each id's weight, > 0")
    tokens: list[str] | None = Field(None, description="Each id's token text (return_tokens)")


class EncodeItem(BaseModel):
    object: Literal["encoding"]
    index: int
    dense: list[float] | str | list[int] | None = None
    sparse: SparseOutput | None = None
    multivector: list[list[float]] | list[str] | list[list[int]] | None = Field(
        None, description="One vector per token the model keeps")


class EncodeResponse(BaseModel):
    object: Literal["list"]
    data: list[EncodeItem]
    model: str
    usage: EmbeddingsUsage


class RerankDocument(BaseModel):
    text: str


class ScoredSpan(BaseModel):
    """Which piece of a document split beside its query scored (chunking): ``document[start:end]``."""

    start: int
    end: int
    pieces: int = Field(description="The pieces the document was scored in")


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None
    span: ScoredSpan | None = Field(None, description="Present when the document was scored piece by piece")


class RerankResponse(BaseModel):
    id: str = Field(min_length=1, description="The request's id (X-Request-Id)")
    results: list[RerankResult] = Field(description="Best first")
    model: str
    usage: EmbeddingsUsage


class TEIRerankResult(BaseModel):
    index: int
    score: float
    text: str | None = None
    span: ScoredSpan | None = Field(None, description="Present when the text was scored piece by piece")


class ClassifyItem(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str = Field(min_length=1, description="The request's id (X-Request-Id)")
    object: Literal["list"]
    data: list[ClassifyItem]
    model: str
    usage: EmbeddingsUsage


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


_ERRORS = {
    400: "Malformed body: not JSON, not UTF-8, empty, or not an object",
    401: "Missing or wrong Bearer key",
    404: "Unknown path; a route of another task than the one served; the admin routes without an admin key",
    409: "A model change in conflict: another in progress, a version already served, no canary",
    413: "Body over limits.max_body_bytes",
    422: "Invalid value, unknown field, or a refused model change",
    503: "Overloaded, not ready or draining (with Retry-After)",
    504: "The request's deadline passed while it was queued",
    507: "A text that does not fit in device memory even alone",
}


def responses(ok: type[BaseModel] | dict[str, Any], *errors: int) -> dict[int | str, Any]:
    """``responses=`` for a route: its success body (a model, or a raw OpenAPI response object) and the
    error statuses it can answer, all in the one error shape."""
    out: dict[int | str, Any] = {200: {"model": ok} if isinstance(ok, type) else ok}
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": _ERRORS[status]}
    return out


def raw_body(media_type: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A success response that is not one of the models above (metrics text, the memory report)."""
    return {"description": "Successful Response", "content": {media_type: {"schema": schema}}}
