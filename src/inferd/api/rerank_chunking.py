"""What the rerank routes share for long documents (a body's ``chunking``; core/long_rerank.py): the engine's
chunking options, and the extension field each result carries when its document was scored piece by piece:
``span``, ``{"start", "end", "pieces"}``, where ``document[start:end]`` is the piece whose score the result holds
(the best piece, for mode mean too) and ``pieces`` how many the document was scored in. A document that fit
beside the query has no span: its score is the one an unsplit request gives, and the answer is the client's
usual one.
"""

from __future__ import annotations

from typing import Any

from inferd.api.schemas import RerankChunkingOptions
from inferd.core.chunking import Chunking
from inferd.core.long_rerank import span_of


def chunking_of(options: RerankChunkingOptions | None) -> Chunking | None:
    """The engine's options for a rerank body's ``chunking`` (their checks run as the request is built)."""
    if options is None:
        return None
    return Chunking(options.mode, options.max_tokens, options.overlap)


def with_span(item: dict[str, Any], output: Any) -> dict[str, Any]:
    """``item`` with the span its score came from, when its document was split."""
    span = span_of(output)
    if span is not None:
        item["span"] = span
    return item
