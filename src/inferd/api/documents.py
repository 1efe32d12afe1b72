"""What the embedding routes share for long documents (a body's ``chunking``; docs/long-documents.md): the
engine's chunking options, the larger body a chunked request may send, and a result in mode ``pieces`` taken
apart so that each route shapes the pooled answer and every piece's with the code it shapes a short text's.

Each route keeps its own answer for the default (``pooled``), which its clients parse unchanged, and adds the
pieces in its own words: OpenAI's and inferd's ``data[i].pieces``, Cohere's ``pieces[i]`` beside
``embeddings``, TEI's ``/embed`` a list of pieces per input (TEI's answer is a bare list of vectors, which has no
room for a span).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request

from inferd.api.errors import APIError
from inferd.api.schemas import ChunkingOptions
from inferd.api.services import services
from inferd.core.chunking import Chunking
from inferd.core.outcomes import TaskResult
from inferd.core.pieces import DocumentPieces

# The routes that take ``chunking``, whose bodies may be up to limits.max_document_body_bytes: the embedding routes,
# and the rerank routes, whose documents are split beside their query (api/rerank_chunking.py). /predict is not
# among them: its path is TEI's /predict too, whose bodies take no chunking.
DOCUMENT_PATHS = ("/v1/embeddings", "/v1/embed", "/v2/embed", "/embed", "/v1/encode", "/rerank", "/v1/rerank",
                  "/v2/rerank")



def chunking_of(options: ChunkingOptions | None) -> Chunking | None:
    """The engine's options for a body's ``chunking`` (its checks run as the request is built)."""
    if options is None:
        return None
    return Chunking(options.mode, options.max_tokens, options.overlap)


async def check_body_size(request: Request, chunking: object | None) -> None:
    """A chunked request's route takes bodies up to limits.max_document_body_bytes (api/app.py); any other
    body stays under limits.max_body_bytes, refused here (413) as the middleware refuses it elsewhere."""
    if chunking is not None:
        return
    limit = services(request).settings.limits.max_body_bytes
    size = len(await request.body())  # already read and kept by the parse: no second read
    if size > limit:
        raise APIError(413, f"request body is larger than the limit of {limit} bytes (limits.max_body_bytes); a "
                       "request that asks for chunking may send up to limits.max_document_body_bytes",
                       "body_too_large")


def taken_apart(result: TaskResult) -> tuple[TaskResult, list[TaskResult] | None]:
    """The result with each document's pooled answer, and (mode ``pieces``) one result per document holding its
    pieces' answers, in order, to be shaped as a request of those pieces would be (None: mode ``pooled``)."""
    if not result.outputs or not isinstance(result.outputs[0], DocumentPieces):
        return result, None
    docs: list[DocumentPieces] = result.outputs
    pooled = dataclasses.replace(result, outputs=[d.pooled for d in docs])
    per_doc = [dataclasses.replace(result, outputs=list(d.outputs), tokens=[p.tokens for p in d.pieces])
               for d in docs]
    return pooled, per_doc


def spans(result: TaskResult, index: int) -> list[dict[str, int]]:
    """Document ``index``'s pieces as ``{start, end, tokens}``: ``text[start:end]`` is the piece, ``tokens`` its
    count by the model's tokenizer (no special tokens), the weight it had in the pooled vector."""
    doc: DocumentPieces = result.outputs[index]
    return [{"start": p.start, "end": p.end, "tokens": p.tokens} for p in doc.pieces]


def with_spans(result: TaskResult, index: int, shaped: list[Any], key: str) -> list[dict[str, Any]]:
    """Each piece of document ``index`` as its span with its shaped answer under ``key``."""
    return [{**span, key: value} for span, value in zip(spans(result, index), shaped, strict=True)]
