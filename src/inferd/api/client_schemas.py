"""The bodies of text-embeddings-inference's routes and Cohere's embed (api/tei*.py, api/cohere.py),
as those projects' own OpenAPI and SDKs define them: validated here for shape, the texts by core.preprocess.

Built on schemas.py's conventions (``_Body``: priority and timeout_ms on every inference body; strict fields;
an unknown field is a 422 naming it), with two exceptions the clients force: TEI's ``truncation_direction``
takes ``Left``/``left``/``Right``/``right`` as TEI does, and Cohere's ``priority`` is Cohere's (lower runs first).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from inferd.api.schemas import _CHUNKING, _TEXT, ChunkingOptions, RerankChunkingOptions, RerankRequest, _Body

_TEXTS = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
Direction = Literal["left", "right", "Left", "Right"]


def direction(value: str) -> Literal["left", "right"]:
    return "left" if value.lower() == "left" else "right"


# -- text-embeddings-inference ------------------------------------------------------------------------------


class TEIEmbedRequest(_Body):
    """TEI's ``POST /embed``: a text or a list of texts → one vector each."""

    inputs: Any = Field(json_schema_extra=_TEXTS)
    normalize: StrictBool = Field(True, description="Unit-length vectors (a model that normalises its own "
                                  "vectors refuses false)")
    truncate: StrictBool | None = Field(None, description="Cut texts over the model's limit (null: "
                                        "model.truncate); false refuses them with 422")
    truncation_direction: Direction = "right"
    prompt_name: str | None = Field(None, description="A prompt of the model's config_sentence_transformers.json "
                                    "(null: its default_prompt_name's, if any)")
    dimensions: StrictInt | None = Field(None, gt=0, description="The model's size, or a smaller Matryoshka size "
                                         "it declares (the first components, renormalised)")
    chunking: ChunkingOptions | None = Field(None, description=_CHUNKING)


class TEIEmbedSparseRequest(_Body):
    """TEI's ``POST /embed_sparse``: a text or a list of texts → each one's nonzero weights by vocabulary id."""

    inputs: Any = Field(json_schema_extra=_TEXTS)
    truncate: StrictBool | None = Field(None, description="Cut texts over the model's limit (null: "
                                        "model.truncate); false refuses them with 422")
    truncation_direction: Direction = "right"
    prompt_name: str | None = Field(None, description="A prompt of the model's config_sentence_transformers.json "
                                    "(null: its default_prompt_name's, if any)")
    # Not TEI's (a TEI server serves one model): inferd's, to name one of several; none = the embedding default.
    model: str | None = Field(None, description="A served embedding model's name (GET /v1/models)")


class TEIEmbedAllRequest(TEIEmbedSparseRequest):
    """TEI's ``POST /embed_all``: a text or a list of texts → each one's token vectors."""


class TEISimilarityInputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source_sentence: Any = Field(json_schema_extra=_TEXT)
    sentences: list[Any] = Field(json_schema_extra={"items": _TEXT, "minItems": 1})


class TEISimilarityParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class TEISimilarityRequest(_Body):
    """TEI's (and the Hugging Face sentence-similarity task's) ``POST /similarity``."""

    inputs: TEISimilarityInputs
    parameters: TEISimilarityParameters | None = None


class TEIClassificationParameters(BaseModel):
    """What ``huggingface_hub``'s text_classification sends beside ``inputs``."""

    model_config = ConfigDict(extra="forbid")

    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="Must be what the model applies; none: the logits, as raw_scores (rerank models only)")
    top_k: StrictInt | None = Field(None, gt=0, description="Only the best this many labels")


_PREDICT_INPUTS = {"anyOf": [
    _TEXT,
    {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 2, "description": "one text, or a pair"},
    {"type": "array", "minItems": 1, "description": "a batch",
     "items": {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 2}}]}


class TEIPredictRequest(_Body):
    """TEI's ``POST /predict``: a text, a pair, or a batch of texts and pairs (``[[text], [a, b], ...]``).

    Told from inferd's own ``/predict`` (``{"texts": [...]}``) by its ``inputs`` field."""

    inputs: Any = Field(json_schema_extra=_PREDICT_INPUTS)
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    raw_scores: StrictBool = Field(False, description="Logits before the activation (rerank models)")
    parameters: TEIClassificationParameters | None = None
    chunking: RerankChunkingOptions | None = Field(None, description="A reranker's pairs: score a document that "
                                                   "does not fit beside its query piece by piece (null: cut it)")


class TEITokenizeRequest(_Body):
    inputs: Any = Field(json_schema_extra=_TEXTS)
    add_special_tokens: StrictBool = True
    prompt_name: str | None = None


class TEIDecodeRequest(_Body):
    ids: Any = Field(json_schema_extra={"anyOf": [_IDS, {"type": "array", "items": _IDS, "minItems": 1}]})
    skip_special_tokens: StrictBool = True


class TEIError(BaseModel):
    """TEI's error shape, on TEI's routes: its clients read ``error`` as a string."""

    error: str
    error_type: Literal["validation", "tokenizer", "empty", "overloaded", "unhealthy", "backend"]


class TEIPrediction(BaseModel):
    score: float
    label: str


class TEIToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


# -- Cohere embed ------------------------------------------------------------------------------------------

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


# Cohere's priority, on every Cohere body (embed and rerank): lower runs first, 0 (the default) the highest, and
# nothing below 0; api/cohere.py turns it into inferd's (higher first) in one place.
CoherePriority = Annotated[StrictInt, Field(ge=0, le=100, description="Cohere's: lower runs first; 0 is the "
                                           "highest (inferd runs it at priority -priority)")]


class CohereRerankRequest(RerankRequest):
    """Cohere's ``POST /v1/rerank`` and ``/v2/rerank`` (Jina's, vLLM's and infinity's too): ``priority`` is Cohere's
    (and vLLM's): lower runs first."""

    priority: CoherePriority = 0


class CohereEmbedRequest(_Body):
    """Cohere's ``POST /v1/embed`` and ``POST /v2/embed`` (what ``cohere.Client`` and ``cohere.ClientV2`` send)."""

    texts: list[Any] = Field(json_schema_extra={"items": _TEXT, "minItems": 1})
    model: str | None = Field(None, description="A served model's name (GET /v1/models), 'name@version' to pin "
                              "a version; none: the default embedding model")
    input_type: Literal["search_document", "search_query", "classification", "clustering", "image"] | None = Field(
        None, description="Picks the model's prompt (model.input_type_prompts; search_query: 'query', "
                          "search_document: 'document' or 'passage', ...); none: the default prompt")
    embedding_types: list[EmbeddingType] | None = Field(None, json_schema_extra={"minItems": 1, "uniqueItems": True})
    truncate: Literal["NONE", "START", "END"] | None = Field(
        None, description="NONE refuses texts over the limit, START cuts their start, END their end; "
                          "none: model.truncate (END)")
    output_dimension: StrictInt | None = Field(None, gt=0, description="The model's size, or a Matryoshka size "
                                               "it declares")
    max_tokens: StrictInt | None = Field(None, gt=0, description="Tokens kept per text, below the model's limit")
    priority: CoherePriority = 0
    images: list[Any] | None = Field(None, description="Not supported: text models only")
    inputs: list[Any] | None = Field(None, description="Not supported: send texts")
    chunking: ChunkingOptions | None = Field(None, description=_CHUNKING)


class CohereEmbeddings(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereMeta(BaseModel):
    api_version: dict[str, Any]
    billed_units: dict[str, int]


class CohereEmbedResponse(BaseModel):
    response_type: Literal["embeddings_floats", "embeddings_by_type"]
    id: str = Field(min_length=1, description="The request's id (X-Request-Id)")
    embeddings: list[list[float]] | CohereEmbeddings
    texts: list[str]
    meta: CohereMeta
