"""Request bodies. Texts are checked by core.preprocess (one place for the rules); these check shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    priority: StrictInt = Field(0, ge=-100, le=100, description="Higher runs first (ageing lifts waiting work)")
    timeout_ms: float | None = Field(None, gt=0, le=600_000,
                                     description="Deadline; a request still queued past it gets 504")


class PredictRequest(_Body):
    """The seed's shape: ``{"texts": [...]}``."""

    texts: list[Any]
    model: str | None = None


class EmbeddingsRequest(_Body):
    """OpenAI's ``POST /v1/embeddings``; ``input`` is a string or a list of strings."""

    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, gt=0)
    user: str | None = None
