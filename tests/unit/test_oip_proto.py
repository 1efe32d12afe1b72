"""inferd's oip.proto against the Open Inference Protocol's gRPC wire facts (KServe v2's grpc_predict_v2.proto, as
Triton's grpc_service.proto extends it): the package, the service's methods with their message types, and every
message's fields (name, number, type, repeated or not) held here as a table the compiled descriptor must match, and
matched again against tritonclient's own compiled descriptor (the client the protocol's users call it with). The
messages live in a descriptor pool of their own (grpc/build.py), so a process imports both."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor
from google.protobuf.descriptor import FieldDescriptor as F
from tritonclient.grpc import service_pb2 as triton

from inferd.grpc.oip import SERVICES, pb

S, B, I64, U64, I32, U32, FL, D, BY, M = (F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_INT32,
                                          F.TYPE_UINT32, F.TYPE_FLOAT, F.TYPE_DOUBLE, F.TYPE_BYTES, F.TYPE_MESSAGE)
ONE, REP = False, True
_PARAMETERS = [("key", 1, S, ONE), ("value", 2, M, ONE)]

# message (nested by dots) -> [(field, number, type, repeated)].
MESSAGES: dict[str, list[tuple[str, int, int, bool]]] = {
    "ServerLiveRequest": [], "ServerLiveResponse": [("live", 1, B, ONE)],
    "ServerReadyRequest": [], "ServerReadyResponse": [("ready", 1, B, ONE)],
    "ModelReadyRequest": [("name", 1, S, ONE), ("version", 2, S, ONE)], "ModelReadyResponse": [("ready", 1, B, ONE)],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [("name", 1, S, ONE), ("version", 2, S, ONE), ("extensions", 3, S, REP)],
    "ModelMetadataRequest": [("name", 1, S, ONE), ("version", 2, S, ONE)],
    "ModelMetadataResponse": [("name", 1, S, ONE), ("versions", 2, S, REP), ("platform", 3, S, ONE),
                              ("inputs", 4, M, REP), ("outputs", 5, M, REP)],
    "ModelMetadataResponse.TensorMetadata": [("name", 1, S, ONE), ("datatype", 2, S, ONE), ("shape", 3, I64, REP)],
    "InferParameter": [("bool_param", 1, B, ONE), ("int64_param", 2, I64, ONE), ("string_param", 3, S, ONE),
                       ("double_param", 4, D, ONE), ("uint64_param", 5, U64, ONE)],
    "InferTensorContents": [("bool_contents", 1, B, REP), ("int_contents", 2, I32, REP),
                            ("int64_contents", 3, I64, REP), ("uint_contents", 4, U32, REP),
                            ("uint64_contents", 5, U64, REP), ("fp32_contents", 6, FL, REP),
                            ("fp64_contents", 7, D, REP), ("bytes_contents", 8, BY, REP)],
    "ModelInferRequest": [("model_name", 1, S, ONE), ("model_version", 2, S, ONE), ("id", 3, S, ONE),
                          ("parameters", 4, M, REP), ("inputs", 5, M, REP), ("outputs", 6, M, REP),
                          ("raw_input_contents", 7, BY, REP)],
    "ModelInferRequest.ParametersEntry": _PARAMETERS,
    "ModelInferRequest.InferInputTensor": [("name", 1, S, ONE), ("datatype", 2, S, ONE), ("shape", 3, I64, REP),
                                           ("parameters", 4, M, REP), ("contents", 5, M, ONE)],
    "ModelInferRequest.InferInputTensor.ParametersEntry": _PARAMETERS,
    "ModelInferRequest.InferRequestedOutputTensor": [("name", 1, S, ONE), ("parameters", 2, M, REP)],
    "ModelInferRequest.InferRequestedOutputTensor.ParametersEntry": _PARAMETERS,
    "ModelInferResponse": [("model_name", 1, S, ONE), ("model_version", 2, S, ONE), ("id", 3, S, ONE),
                           ("parameters", 4, M, REP), ("outputs", 5, M, REP), ("raw_output_contents", 6, BY, REP)],
    "ModelInferResponse.ParametersEntry": _PARAMETERS,
    "ModelInferResponse.InferOutputTensor": [("name", 1, S, ONE), ("datatype", 2, S, ONE), ("shape", 3, I64, REP),
                                             ("parameters", 4, M, REP), ("contents", 5, M, ONE)],
    "ModelInferResponse.InferOutputTensor.ParametersEntry": _PARAMETERS,
}
METHODS = {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"}


def _message(file: object, dotted: str) -> Descriptor:
    parts = dotted.split(".")
    found = file.message_types_by_name[parts[0]]  # type: ignore[attr-defined]
    for part in parts[1:]:
        found = found.nested_types_by_name[part]
    return found


def _fields(d: Descriptor) -> list[tuple[str, int, int, bool]]:
    return [(f.name, f.number, f.type, f.is_repeated) for f in d.fields]


def test_the_compiled_proto_matches_the_protocols_wire_facts() -> None:
    assert pb.DESCRIPTOR.package == "inference"
    assert SERVICES == ("inference.GRPCInferenceService",)
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert {m.name for m in service.methods} == METHODS
    for method in service.methods:
        assert (method.input_type.name, method.output_type.name) == (f"{method.name}Request", f"{method.name}Response")
        assert not method.client_streaming and not method.server_streaming
    for name, fields in MESSAGES.items():
        assert _fields(_message(pb.DESCRIPTOR, name)) == fields, name
    top = {n for n in MESSAGES if "." not in n}
    assert set(pb.DESCRIPTOR.message_types_by_name) == top
    assert [o.name for o in _message(pb.DESCRIPTOR, "InferParameter").oneofs] == ["parameter_choice"]


def test_every_message_and_method_is_tritonclients_field_for_field() -> None:
    theirs = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == \
            (other.input_type.full_name, other.output_type.full_name)
    for name in MESSAGES:
        assert _fields(_message(pb.DESCRIPTOR, name)) == _fields(_message(triton.DESCRIPTOR, name)), name


def test_the_messages_round_trip_through_tritonclients_classes() -> None:
    ours = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\x02\x00\x00\x00hi"])
    ours.inputs.add(name="text", datatype="BYTES", shape=[1])
    ours.parameters["priority"].int64_param = 2
    theirs = triton.ModelInferRequest.FromString(ours.SerializeToString())
    assert (theirs.model_name, theirs.inputs[0].name, list(theirs.inputs[0].shape)) == ("m", "text", [1])
    assert theirs.parameters["priority"].int64_param == 2 and theirs.raw_input_contents[0] == b"\x02\x00\x00\x00hi"
