"""The Open Inference Protocol's tensors on the wire (KServe v2, as Triton, KServe, MLServer and OpenVINO Model
Server speak it over HTTP): an infer request's input tensors read, its output tensors written, in JSON or with
the binary tensor extension. Not a route module: api/oip.py builds on it.

JSON tensors are ``{"name", "shape", "datatype", "data"}``, ``data`` row-major (flat or nested). The binary
extension is what ``tritonclient.http`` sends and asks for by default (``set_data_from_numpy(binary_data=True)``,
``InferRequestedOutput(binary_data=True)``): the body is the JSON header (its length in the
``Inference-Header-Content-Length`` header) followed by each binary tensor's bytes, a tensor naming its size in
``parameters.binary_data_size``. A BYTES element in binary is a 4-byte little-endian length and its bytes; an FP32
one four little-endian bytes.

Every refusal is an ``OIPError`` (400: the request as sent is not a valid infer request), answered in the
protocol's ``{"error": message}`` by api/oip.py.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from inferd.core.errors import excerpt

HEADER_LENGTH = "inference-header-content-length"
BINARY = "application/octet-stream"
# The datatypes of the protocol; inferd's tensors are BYTES (texts, labels) and FP32 (vectors, scores).
DATATYPES = frozenset({"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
                       "FP32", "FP64", "BF16", "BYTES"})
_LENGTH = struct.Struct("<I")


class OIPError(Exception):
    """An infer request the protocol refuses as sent (400), or another status where given."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor in a model's metadata: its name, datatype and shape (-1: any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class InferBody:
    """An infer request as read: its id, parameters, input texts by name, and the outputs asked for (name ->
    binary?; None: every output, in binary when ``binary_default``)."""

    id: str | None
    parameters: Mapping[str, Any]
    inputs: dict[str, list[str]]
    outputs: dict[str, bool] | None
    binary_default: bool


def read_infer(raw: bytes, header_length: str | None) -> InferBody:
    """An infer request body: JSON, or (``header_length`` given) a JSON header and the binary tensors after it."""
    split = _header_length(header_length, len(raw))
    header, rest = (raw, b"") if split is None else (raw[:split], raw[split:])
    if not header.strip():
        raise OIPError("the request body is empty; send an inference request (a JSON object with \"inputs\")")
    try:
        data = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise OIPError(f"the inference request is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OIPError("the inference request must be a JSON object")
    tensors = data.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise OIPError("inputs: must be a non-empty list of tensors")
    offset = 0
    inputs: dict[str, list[str]] = {}
    for i, tensor in enumerate(tensors):
        name, texts, offset = _input(tensor, i, rest, offset)
        if name in inputs:
            raise OIPError(f"inputs[{i}]: a second input named {excerpt(name)!r}")
        inputs[name] = texts
    if offset != len(rest):
        raise OIPError(f"the body holds {len(rest)} bytes of binary tensors; the inputs name {offset}")
    parameters = data.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise OIPError("parameters: must be an object")
    request_id = data.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise OIPError("id: must be a string")
    return InferBody(request_id, parameters, inputs, _outputs(data.get("outputs")),
                     parameters.get("binary_data_output") is True)


def _header_length(value: str | None, size: int) -> int | None:
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        length = -1
    if not 0 < length <= size:
        raise OIPError(f"Inference-Header-Content-Length: must be the JSON header's length, 1 to {size} bytes, "
                       f"not {excerpt(value)!r}")
    return length


def _input(tensor: Any, i: int, rest: bytes, offset: int) -> tuple[str, list[str], int]:
    """One input tensor's name and texts, and the binary offset after it."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise OIPError(f"inputs[{i}]: must be a tensor object with a name, shape, datatype and data")
    name = tensor["name"]
    params = tensor.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is None:
        return name, tensor_texts(name, tensor.get("datatype"), tensor.get("shape"), data=tensor.get("data")), offset
    if type(size) is not int or size < 0 or offset + size > len(rest):
        raise OIPError(f"input {excerpt(name)!r}: binary_data_size {size!r} is past the end of the body")
    raw = rest[offset:offset + size]
    return name, tensor_texts(name, tensor.get("datatype"), tensor.get("shape"), raw=raw), offset + size


def tensor_texts(name: str, datatype: Any, shape: Any, *, data: Any = None, raw: bytes | None = None) -> list[str]:
    """A BYTES input tensor's texts: its JSON ``data``, or ``raw``, its elements in binary (the binary extension's
    bytes over HTTP, ``raw_input_contents`` over gRPC); the datatype and the shape checked against them."""
    where = f"input {excerpt(name)!r}"
    if not isinstance(datatype, str) or datatype not in DATATYPES:  # a list or an object is not hashable
        raise OIPError(f"{where}: datatype {excerpt(str(datatype))!r} is not one of the protocol's")
    if datatype != "BYTES":
        raise OIPError(f"{where}: datatype {datatype}; this input takes BYTES (UTF-8 texts)")
    if (not isinstance(shape, list) or not shape
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise OIPError(f"{where}: shape must be a non-empty list of sizes (integers, 0 and up)")
    count = math.prod(shape)
    texts = _binary_texts(raw, where) if raw is not None else _json_texts(data, where)
    if len(texts) != count:
        raise OIPError(f"{where}: shape {shape} holds {count} elements; {len(texts)} were sent")
    return texts


def _json_texts(data: Any, where: str) -> list[str]:
    if not isinstance(data, list):
        raise OIPError(f"{where}: data must be a list (or parameters.binary_data_size for binary data)")
    flat = _flatten(data)  # row-major: nested rows are read in order
    if not all(isinstance(t, str) for t in flat):
        raise OIPError(f"{where}: a BYTES tensor's JSON data holds strings")
    return flat


def _flatten(data: list[Any]) -> list[Any]:
    """Nested lists in row-major order, without recursion: a deeply nested body cannot exhaust the stack."""
    out: list[Any] = []
    pending: list[tuple[list[Any], int]] = [(data, 0)]
    while pending:
        items, j = pending.pop()
        while j < len(items):
            item = items[j]
            j += 1
            if isinstance(item, list):
                pending.append((items, j))
                items, j = item, 0
                continue
            out.append(item)
    return out


def _binary_texts(raw: bytes, where: str) -> list[str]:
    texts, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise OIPError(f"{where}: its binary data ends inside an element's length")
        (length,) = _LENGTH.unpack_from(raw, at)
        at += 4
        if at + length > len(raw):
            raise OIPError(f"{where}: an element of {length} bytes runs past its binary data")
        try:
            texts.append(raw[at:at + length].decode("utf-8"))
        except UnicodeDecodeError:
            raise OIPError(f"{where}: element {len(texts)} is not UTF-8 text") from None
        at += length
    return texts


def _outputs(requested: Any) -> dict[str, bool] | None:
    if requested is None:
        return None
    if not isinstance(requested, list):
        raise OIPError("outputs: must be a list of {\"name\"} objects")
    out: dict[str, bool] = {}
    for i, item in enumerate(requested):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise OIPError(f"outputs[{i}]: must be an object with a name")
        params = item.get("parameters") or {}
        out[item["name"]] = isinstance(params, dict) and params.get("binary_data") is True
    return out


# -- the answer --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One output's values: FP32 as a float array of its shape, BYTES as texts (shape ``[n]``)."""

    name: str
    datatype: str
    values: np.ndarray | Sequence[str]

    @property
    def shape(self) -> list[int]:
        return list(self.values.shape) if isinstance(self.values, np.ndarray) else [len(self.values)]

    def binary(self) -> bytes:
        if isinstance(self.values, np.ndarray):
            return np.ascontiguousarray(self.values, dtype="<f4").tobytes()
        return b"".join(_LENGTH.pack(len(b)) + b for b in (t.encode("utf-8") for t in self.values))

    def data(self) -> list[Any]:
        if isinstance(self.values, np.ndarray):
            return [float(x) for x in np.asarray(self.values, dtype=np.float32).ravel().astype(np.float64)]
        return list(self.values)


def write_infer(head: dict[str, Any], outputs: list[tuple[OutputTensor, bool]]) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, the JSON header's length (None: all JSON)."""
    tensors, chunks = [], []
    for tensor, binary in outputs:
        wire: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        if binary:
            raw = tensor.binary()
            wire["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            wire["data"] = tensor.data()
        tensors.append(wire)
    header = orjson.dumps({**head, "outputs": tensors})
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)
