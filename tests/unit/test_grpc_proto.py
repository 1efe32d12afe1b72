"""inferd's tei.proto against text-embeddings-inference's published wire facts (huggingface/text-embeddings-inference,
proto/tei.proto): the package, each service's methods with their streaming and message types, each enum's values,
and every message's fields (name, number, type, label, proto3 ``optional``) held here as tables that the compiled
descriptors must match exactly, so a stub generated from TEI's proto works against inferd unchanged.

Also: the build step compiles the proto into a folder of its own; every kind of refusal has a gRPC status; a
call's deadline becomes the request's timeout, a little short of it.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from inferd.api.errors import Names, engine_refusal
from inferd.core.errors import EngineError, Kind, deadline_passed
from inferd.grpc import build, call
from inferd.grpc.call import Call, deadline_ms, streaming
from inferd.grpc.status import CODES, Refused, refused
from inferd.grpc.stubs import pb
from inferd.utils.logger import request_id_var

S, U32, U64, B, FL, E, M = (F.TYPE_STRING, F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_BOOL, F.TYPE_FLOAT, F.TYPE_ENUM,
                            F.TYPE_MESSAGE)
ONE, REP, OPT = "singular", "repeated", "optional"  # OPT: proto3 `optional` (explicit presence)

# TEI's messages: message -> [(field name, number, type, label, message or enum type)].
MESSAGES: dict[str, list[tuple[str, int, int, str, str | None]]] = {
    "InfoRequest": [],
    "InfoResponse": [("version", 1, S, ONE, None), ("sha", 2, S, OPT, None), ("docker_label", 3, S, OPT, None),
                     ("model_id", 4, S, ONE, None), ("model_sha", 5, S, OPT, None), ("model_dtype", 6, S, ONE, None),
                     ("model_type", 7, E, ONE, "ModelType"), ("max_concurrent_requests", 8, U32, ONE, None),
                     ("max_input_length", 9, U32, ONE, None), ("max_batch_tokens", 10, U32, ONE, None),
                     ("max_batch_requests", 11, U32, OPT, None), ("max_client_batch_size", 12, U32, ONE, None),
                     ("tokenization_workers", 13, U32, ONE, None)],
    "Metadata": [("compute_chars", 1, U32, ONE, None), ("compute_tokens", 2, U32, ONE, None),
                 ("total_time_ns", 3, U64, ONE, None), ("tokenization_time_ns", 4, U64, ONE, None),
                 ("queue_time_ns", 5, U64, ONE, None), ("inference_time_ns", 6, U64, ONE, None)],
    "EmbedRequest": [("inputs", 1, S, ONE, None), ("truncate", 2, B, ONE, None), ("normalize", 3, B, OPT, None),
                     ("truncation_direction", 4, E, ONE, "TruncationDirection"), ("prompt_name", 5, S, OPT, None),
                     ("dimensions", 6, U32, OPT, None)],
    "EmbedResponse": [("embeddings", 1, FL, REP, None), ("metadata", 2, M, ONE, "Metadata")],
    "EmbedSparseRequest": [("inputs", 1, S, ONE, None), ("truncate", 2, B, ONE, None),
                           ("truncation_direction", 3, E, ONE, "TruncationDirection"),
                           ("prompt_name", 4, S, OPT, None)],
    "SparseValue": [("index", 1, U32, ONE, None), ("value", 2, FL, ONE, None)],
    "EmbedSparseResponse": [("sparse_embeddings", 1, M, REP, "SparseValue"), ("metadata", 2, M, ONE, "Metadata")],
    "EmbedAllRequest": [("inputs", 1, S, ONE, None), ("truncate", 2, B, ONE, None),
                        ("truncation_direction", 3, E, ONE, "TruncationDirection"), ("prompt_name", 4, S, OPT, None)],
    "TokenEmbedding": [("embeddings", 1, FL, REP, None)],
    "EmbedAllResponse": [("token_embeddings", 1, M, REP, "TokenEmbedding"), ("metadata", 2, M, ONE, "Metadata")],
    "PredictRequest": [("inputs", 1, S, ONE, None), ("truncate", 2, B, ONE, None), ("raw_scores", 3, B, ONE, None),
                       ("truncation_direction", 4, E, ONE, "TruncationDirection")],
    "PredictPairRequest": [("inputs", 1, S, REP, None), ("truncate", 2, B, ONE, None),
                           ("raw_scores", 3, B, ONE, None), ("truncation_direction", 4, E, ONE, "TruncationDirection")],
    "Prediction": [("score", 1, FL, ONE, None), ("label", 2, S, ONE, None)],
    "PredictResponse": [("predictions", 1, M, REP, "Prediction"), ("metadata", 2, M, ONE, "Metadata")],
    "RerankRequest": [("query", 1, S, ONE, None), ("texts", 2, S, REP, None), ("truncate", 3, B, ONE, None),
                      ("raw_scores", 4, B, ONE, None), ("return_text", 5, B, ONE, None),
                      ("truncation_direction", 6, E, ONE, "TruncationDirection")],
    "RerankStreamRequest": [("query", 1, S, ONE, None), ("text", 2, S, ONE, None), ("truncate", 3, B, ONE, None),
                            ("raw_scores", 4, B, ONE, None), ("return_text", 5, B, ONE, None),
                            ("truncation_direction", 6, E, ONE, "TruncationDirection")],
    "Rank": [("index", 1, U32, ONE, None), ("text", 2, S, OPT, None), ("score", 3, FL, ONE, None)],
    "RerankResponse": [("ranks", 1, M, REP, "Rank"), ("metadata", 2, M, ONE, "Metadata")],
    "EncodeRequest": [("inputs", 1, S, ONE, None), ("add_special_tokens", 2, B, ONE, None),
                      ("prompt_name", 3, S, OPT, None)],
    "SimpleToken": [("id", 1, U32, ONE, None), ("text", 2, S, ONE, None), ("special", 3, B, ONE, None),
                    ("start", 4, U32, OPT, None), ("stop", 5, U32, OPT, None)],
    "EncodeResponse": [("tokens", 1, M, REP, "SimpleToken")],
    "DecodeRequest": [("ids", 1, U32, REP, None), ("skip_special_tokens", 2, B, ONE, None)],
    "DecodeResponse": [("text", 1, S, ONE, None)],
}
ENUMS = {"ModelType": [("MODEL_TYPE_EMBEDDING", 0), ("MODEL_TYPE_CLASSIFIER", 1), ("MODEL_TYPE_RERANKER", 2)],
         "TruncationDirection": [("TRUNCATION_DIRECTION_RIGHT", 0), ("TRUNCATION_DIRECTION_LEFT", 1)]}
# service -> [(method, client streams, server streams, input, output)]
SERVICES = {
    "Info": [("Info", False, False, "InfoRequest", "InfoResponse")],
    "Embed": [("Embed", False, False, "EmbedRequest", "EmbedResponse"),
              ("EmbedStream", True, True, "EmbedRequest", "EmbedResponse"),
              ("EmbedSparse", False, False, "EmbedSparseRequest", "EmbedSparseResponse"),
              ("EmbedSparseStream", True, True, "EmbedSparseRequest", "EmbedSparseResponse"),
              ("EmbedAll", False, False, "EmbedAllRequest", "EmbedAllResponse"),
              ("EmbedAllStream", True, True, "EmbedAllRequest", "EmbedAllResponse")],
    "Predict": [("Predict", False, False, "PredictRequest", "PredictResponse"),
                ("PredictPair", False, False, "PredictPairRequest", "PredictResponse"),
                ("PredictStream", True, True, "PredictRequest", "PredictResponse"),
                ("PredictPairStream", True, True, "PredictPairRequest", "PredictResponse")],
    "Rerank": [("Rerank", False, False, "RerankRequest", "RerankResponse"),
               ("RerankStream", True, False, "RerankStreamRequest", "RerankResponse")],
    "Tokenize": [("Tokenize", False, False, "EncodeRequest", "EncodeResponse"),
                 ("TokenizeStream", True, True, "EncodeRequest", "EncodeResponse"),
                 ("Decode", False, False, "DecodeRequest", "DecodeResponse"),
                 ("DecodeStream", True, True, "DecodeRequest", "DecodeResponse")],
}


def _label(field: F) -> str:
    if field.is_repeated:
        return REP
    return OPT if field.has_presence and field.type != F.TYPE_MESSAGE else ONE


def _fields(descriptor: object) -> list[tuple[str, int, int, str, str | None]]:
    out = []
    for f in descriptor.fields:  # type: ignore[attr-defined]
        of = f.message_type or f.enum_type
        out.append((f.name, f.number, f.type, _label(f), of.name if of is not None else None))
    return out


def test_the_package_and_every_message_enum_and_service_are_teis() -> None:
    file = pb.DESCRIPTOR
    assert file.package == "tei.v1"
    assert sorted(file.message_types_by_name) == sorted(MESSAGES)
    for name, fields in MESSAGES.items():
        assert _fields(file.message_types_by_name[name]) == fields, name
        for field in file.message_types_by_name[name].fields:
            if field.message_type is not None or field.enum_type is not None:
                assert (field.message_type or field.enum_type).full_name.startswith("tei.v1."), name
    assert {n: [(v.name, v.number) for v in e.values] for n, e in file.enum_types_by_name.items()} == ENUMS
    assert sorted(file.services_by_name) == sorted(SERVICES)
    for name, methods in SERVICES.items():
        got = [(m.name, m.client_streaming, m.server_streaming, m.input_type.name, m.output_type.name)
               for m in file.services_by_name[name].methods]
        assert got == methods, name


def test_the_table_would_catch_a_renumbered_or_retyped_field() -> None:
    wrong = {**MESSAGES, "EmbedRequest": [(n, 7 if n == "dimensions" else k, t, lab, of)
                                          for n, k, t, lab, of in MESSAGES["EmbedRequest"]]}
    assert _fields(pb.DESCRIPTOR.message_types_by_name["EmbedRequest"]) != wrong["EmbedRequest"]
    assert _label(pb.DESCRIPTOR.message_types_by_name["EmbedRequest"].fields_by_name["truncate"]) == ONE
    assert _label(pb.DESCRIPTOR.message_types_by_name["EmbedRequest"].fields_by_name["normalize"]) == OPT


def test_the_build_step_compiles_the_proto_into_a_folder_of_its_own(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    gen = build.build(tmp_path)
    assert gen == tmp_path / "inferd" / "grpc" / "_gen"
    assert {p.name for p in gen.iterdir()} >= {"__init__.py", "tei_pb2.py", "tei_pb2_grpc.py"}
    # The generated service module imports its messages by their package path, not a bare ``tei_pb2``.
    assert "from inferd.grpc._gen import tei_pb2" in (gen / "tei_pb2_grpc.py").read_text()
    source = (gen / "tei_pb2.py").read_text()
    assert "tei.v1" in source and "EmbedSparseRequest" in source
    # A proto that does not compile is an error naming protoc, not a silent empty folder.
    bad = tmp_path / "bad.proto"
    bad.write_text('syntax = "proto3";\nmessage X { strng a = 1; }\n')
    monkeypatch.setattr(build, "PROTO", bad)
    with pytest.raises(RuntimeError, match="protoc"):
        build.build(tmp_path / "other")


def test_every_kind_has_a_grpc_status_and_the_kind_table_is_followed() -> None:
    assert set(CODES) == set(Kind)
    assert refused(engine_refusal(deadline_passed(), Names("inputs"))).code is grpc.StatusCode.DEADLINE_EXCEEDED
    overloaded = refused(engine_refusal(EngineError(Kind.OVERLOADED, "the queue is full"), Names("inputs")))
    assert overloaded.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "1") in overloaded.trailers
    too_long = refused(engine_refusal(EngineError(Kind.TOO_LONG, "too long", "text_too_long", index=0),
                                      Names("inputs", False)))
    assert (too_long.code, too_long.message) == (grpc.StatusCode.INVALID_ARGUMENT, "inputs: too long")
    for kind, code in {Kind.NOT_READY: "UNAVAILABLE", Kind.DRAINING: "UNAVAILABLE", Kind.WRONG_TASK:
                       "FAILED_PRECONDITION", Kind.MODEL_NOT_FOUND: "NOT_FOUND", Kind.FAILED: "INTERNAL"}.items():
        assert refused(engine_refusal(EngineError(kind, "x"), Names("inputs"))).code.name == code


class _Context:
    def __init__(self, left: float | None, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.left = left
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[SimpleNamespace, ...]:
        return tuple(SimpleNamespace(key=k, value=v) for k, v in self.metadata)

    def time_remaining(self) -> float | None:
        return self.left


def _call(context: _Context) -> Call:
    from inferd.api.services import Services

    services = object.__new__(Services)
    app = SimpleNamespace(state=SimpleNamespace(services=services))
    return Call(app, context, "/tei.v1.Embed/Embed")  # type: ignore[arg-type]


def test_the_call_deadline_becomes_the_requests_timeout_a_little_short_of_it() -> None:
    assert deadline_ms(2.0) == pytest.approx(1980.0)  # 20 ms short: the server's answer arrives first
    assert deadline_ms(0.05) == pytest.approx(45.0)  # a tenth of a short one
    assert deadline_ms(10_000.0) == 600_000.0  # the longest timeout a request may ask
    assert _call(_Context(0.5, (("x-priority", "3"), ("x-model", "m@v2")))).options() | {"tenant": None} == {
        "tenant": None, "routing_key": None, "model": "m@v2", "priority": 3, "timeout_ms": deadline_ms(0.5)}
    assert "timeout_ms" not in _call(_Context(None)).options()  # no deadline: the model's default timeout
    with pytest.raises(Refused) as passed:
        _call(_Context(-0.1)).options()
    assert passed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(Refused) as bad:
        _call(_Context(None, (("x-priority", "high"),))).options()
    assert bad.value.code is grpc.StatusCode.INVALID_ARGUMENT and "x-priority" in bad.value.message


class _Series:
    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    def labels(self, *labels: str) -> _Series:
        self.seen.append(labels)
        return self

    def inc(self) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


def test_a_stream_closed_by_the_event_loop_after_its_client_went_is_cancelled_without_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that cancels a stream while grpcio is sending an answer: grpcio stops reading the servicer's
    generator, which the event loop's finaliser closes later, in a task (and a context) of its own. That close is
    the client's going (CANCELLED, not OK), and the request id's context is let go without a ValueError."""
    counted = _Series()
    s = SimpleNamespace(metrics=SimpleNamespace(requests=counted, request_duration=_Series()),
                        settings=SimpleNamespace(server=SimpleNamespace(access_log=False)))

    async def begin(app: object, context: object, method: str) -> tuple[SimpleNamespace, list[object]]:
        return SimpleNamespace(s=s, method=method, ctx={}, messages=0), [request_id_var.set("a-stream")]

    monkeypatch.setattr(call, "_begin", begin)

    @streaming("/tei.v1.Embed/EmbedStream")
    async def answers(self: object, call_: object, messages: object) -> AsyncIterator[int]:
        for i in range(3):
            yield i

    async def scenario() -> None:
        stream = answers(SimpleNamespace(app=None), None, None)

        async def first() -> int:
            return await stream.__anext__()

        async def close() -> None:
            await stream.aclose()

        assert await asyncio.create_task(first()) == 0  # grpcio's handler task reads the first answer
        await asyncio.create_task(close())  # the finaliser closes the generator in a task of its own

    asyncio.run(scenario())
    assert counted.seen == [("/tei.v1.Embed/EmbedStream", "CANCELLED", "")]


def test_missing_stubs_are_an_error_naming_the_build_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "inferd.grpc._gen", None)  # as if never generated
    monkeypatch.delitem(sys.modules, "inferd.grpc.stubs")
    with pytest.raises(ImportError, match="python -m inferd.grpc.build"):
        importlib.import_module("inferd.grpc.stubs")
