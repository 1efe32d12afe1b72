"""What the routes of sparse and multi-vector outputs share (TEI's /embed_sparse and /embed_all, inferd's
/v1/encode): the outputs a request asks for as the texts the engine takes, the check that the model that answered
gives them, the limit on the token vectors of one answer, and each output's wire shape.

The outputs travel with each text (core/preprocess.py TextInput ``outputs``), so the result cache keys an entry by
them and a handler fills exactly those (core/outputs.py). Whether the model gives them is read from the description
of the load that answered (its ``outputs`` fact; a model without one gives its dense vector only): a dense-only
model ignores what it cannot give, so the answer, never the text, is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd.api.errors import APIError, refusal
from inferd.core import quantize
from inferd.core.errors import Kind
from inferd.core.outputs import OUTPUTS, SparseVector, TextOutputs
from inferd.core.preprocess import Direction, TextInput
from inferd.core.slots import ModelDescription
from inferd.core.work import TaskResult

# The encodings of a dense vector or a token vector; int8/uint8 need calibration ranges measured for the dense
# vectors only (core/quantize.py), so they are Cohere's /v2/embed's and not offered here.
ENCODINGS = ("float", "base64", "binary", "ubinary")


def asking(texts: Sequence[str], outputs: Sequence[str], direction: Direction = "right",
           truncate: bool | None = None) -> list[Any]:
    """The engine's inputs: each text with the outputs asked (in OUTPUTS' order) and the request's cut choices. A
    dense vector alone is what every embedding model answers unasked, so such a text asks nothing and shares its
    cache entry with /v1/embeddings' and /embed's."""
    wanted = tuple(k for k in OUTPUTS if k in outputs)
    asked = None if wanted == ("dense",) else wanted
    if asked is None and direction == "right" and truncate is None:
        return list(texts)
    return [TextInput(t, direction=direction, truncate=truncate, outputs=asked) for t in texts]


def offered(description: ModelDescription) -> tuple[str, ...]:
    """The outputs the model load gives (its handler's ``outputs``), a dense vector when it names none."""
    named = description.facts.get("outputs")
    return tuple(named) if named else ("dense",)


def outputs_of(result: TaskResult, wanted: Sequence[str], param: str | None = "outputs") -> list[TextOutputs]:
    """Each text's outputs, refused (422, naming ``param`` and what the model gives) when the model that answered
    does not give one asked."""
    gives = offered(result.description)
    missing = [k for k in wanted if k not in gives]
    if missing:
        raise refusal(Kind.INVALID_INPUT, f"{param + ': ' if param else ''}{', '.join(missing)} asked; model "
                      f"{result.model!r} gives {', '.join(gives)}", "unsupported_output", param)
    out = [o if isinstance(o, TextOutputs) else TextOutputs(dense=np.asarray(o)) for o in result.outputs]
    for o in out:
        if any(getattr(o, k) is None for k in wanted):  # a handler that answered less than it was asked
            raise APIError(500, f"model {result.model!r} did not give the outputs asked ({', '.join(wanted)})",
                           "internal_error")
    return out


def check_token_vectors(outputs: Sequence[TextOutputs], limit: int, param: str = "inputs") -> None:
    """A multi-vector answer is tokens x dimension floats per text: over ``limits.max_multivector_tokens`` token
    vectors in all, it is refused (422, too long, naming the setting) rather than sent."""
    count = sum(len(o.multivector) for o in outputs if o.multivector is not None)
    if count > limit:
        raise refusal(Kind.TOO_LONG, f"{param}: the multi-vector output of this request holds {count} token "
                      f"vectors; at most {limit} per response (limits.max_multivector_tokens): send fewer or "
                      "shorter texts", "too_many_token_vectors", param)


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
    packed sign bits (binary: int8, ubinary: uint8)."""
    rows = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
    if encoding == "base64":
        out: Any = quantize.as_base64(rows)
    elif encoding in ("binary", "ubinary"):
        out = quantize.quantize(rows, encoding).tolist()
    else:
        out = rows.tolist()
    return out if np.ndim(vectors) == 2 else out[0]
