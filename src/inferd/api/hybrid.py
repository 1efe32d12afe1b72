"""What the routes of sparse and multi-vector outputs share (TEI's /embed_sparse and /embed_all, inferd's
/v1/encode): each text's outputs from the result, the limits on the token vectors and the sparse weights of one
answer, and each output's wire shape.

The routes name the outputs on the engine's request (core/request.py ``outputs``); the engine refuses those the
model does not give before any work and hands them to the handler with each text, which keys the result cache by
them too (core/admission.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd.api.errors import APIError, refusal
from inferd.core import quantize
from inferd.core.errors import Kind
from inferd.core.outcomes import TaskResult
from inferd.core.outputs import SparseVector, TextOutputs, token_vectors_refusal


def outputs_of(result: TaskResult, wanted: Sequence[str]) -> list[TextOutputs]:
    """Each text's outputs (a bare vector is a dense output). The engine refused, before any work, outputs the
    model does not give (core/tasks/embedding_task.py missing_outputs); a handler that answered less is a fault, not a
    refusal."""
    out = [o if isinstance(o, TextOutputs) else TextOutputs(dense=np.asarray(o)) for o in result.outputs]
    for o in out:
        if any(getattr(o, k) is None for k in wanted):
            raise APIError(500, f"model {result.model!r} did not give the outputs asked ({', '.join(wanted)})",
                           "internal_error")
    return out


def check_token_vectors(outputs: Sequence[TextOutputs], limit: int, param: str = "inputs") -> None:
    """A multi-vector answer is tokens x dimension floats per text: over ``limits.max_multivector_tokens`` token
    vectors in all, it is refused (422, too long, naming the setting) rather than sent. The model refuses such a
    request from its token counts before the pass (core/tasks/base.py TokenVectorTask); this holds the answer to it
    when cached outputs join fresh ones, or the limit changed under a loaded model."""
    count = sum(len(v) for o in outputs for v in (o.multivector, o.token_states) if v is not None)
    if count > limit:
        raise refusal(Kind.TOO_LONG, f"{param}: {token_vectors_refusal(count, limit)}", "too_many_token_vectors",
                      param)


def check_sparse_weights(outputs: Sequence[TextOutputs], limit: int, param: str = "inputs") -> None:
    """A sparse answer is an (id, weight) pair per nonzero weight, up to the whole vocabulary per text (a SPLADE
    vector's count is known only once the model has run): over ``limits.max_sparse_weights`` in all, it is refused
    (422, too long, naming the setting and ``model.sparse_top_k``, each text's cap) before it is built."""
    count = sum(len(o.sparse) for o in outputs if o.sparse is not None)
    if count > limit:
        raise refusal(Kind.TOO_LONG, f"{param}: the sparse output of this request holds {count} weights; at most "
                      f"{limit} per response (limits.max_sparse_weights; model.sparse_top_k caps each text's): "
                      "send fewer texts", "too_many_sparse_weights", param)


def sparse_object(vector: SparseVector, tokens: bool) -> dict[str, Any]:
    """``{indices, values}`` (Qdrant's ``SparseVector`` and Milvus' sparse rows take these), with each id's
    token text when asked."""
    out: dict[str, Any] = {"indices": vector.indices.tolist(), "values": vector.values.astype(np.float64).tolist()}
    if tokens:
        out["tokens"] = list(vector.tokens or ())
    return out


def sparse_pairs(vector: SparseVector) -> list[dict[str, Any]]:
    """TEI's ``[{"index", "value"}]``."""
    return [{"index": int(i), "value": float(v)} for i, v in zip(vector.indices, vector.values, strict=True)]


def encoded(vectors: np.ndarray, encoding: str) -> Any:
    """Rows (a dense vector's one, a multi-vector's many) in ``encoding``: float lists, base64 of float32, or
    packed sign bits (binary: int8, ubinary: uint8). Not int8/uint8: their calibration ranges are measured on dense
    vectors only (core/quantize.py)."""
    rows = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
    if encoding == "base64":
        out: Any = quantize.as_base64(rows)
    elif encoding in ("binary", "ubinary"):
        out = quantize.quantize(rows, encoding).tolist()
    else:
        out = rows.tolist()
    return out if np.ndim(vectors) == 2 else out[0]
