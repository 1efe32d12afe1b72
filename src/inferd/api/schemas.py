"""HTTP request bodies, validated here for shape; texts are checked by core.preprocess, the one place for
those rules. The bodies of the other client families build on these conventions (api/client_schemas.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

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
