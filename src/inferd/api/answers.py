"""HTTP answers of the inference routes, and the one error shape, with the helpers that declare a route's
responses in the OpenAPI schema. Documentation only: the routes build their answers with orjson, so these
describe them, and the fuzz tests hold the answers to them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


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
