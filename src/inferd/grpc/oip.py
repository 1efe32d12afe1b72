"""The Open Inference Protocol (KServe v2) over gRPC: ``inference.GRPCInferenceService``'s health, metadata and
ModelInfer RPCs (proto/oip.proto) on the gRPC port beside TEI's services, so ``tritonclient.grpc`` calls inferd
unchanged. Registered with the one gRPC server (grpc/server.py) by ``oip_services``.

The models, their tensors and an infer request's plan are the HTTP routes' (api/oip_tasks.py); each RPC is a
grpc/call.py Call (the key and its tenant, the deadline, metrics, the access log and the trace, as TEI's RPCs).
Inputs are BYTES tensors in ``contents.bytes_contents`` or in ``raw_input_contents`` (tritonclient.grpc's default:
each element a 4-byte little-endian length and its bytes); outputs are answered in ``raw_output_contents`` (FP32
little-endian, BYTES as inputs), which tritonclient reads. A request the protocol refuses is INVALID_ARGUMENT (a
model or version not served NOT_FOUND); an engine refusal has its kind's status (grpc/status.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from inferd import __version__
from inferd.api.health import readiness
from inferd.api.oip_tasks import check_version, description_of, plan, served_model, signature_of, versions_of
from inferd.api.oip_tensors import InferBody, OIPError, tensor_texts
from inferd.grpc.call import Call, unary
from inferd.grpc.status import Code, Refused

try:
    from inferd.grpc._gen import oip_pb2 as pb
    from inferd.grpc._gen import oip_pb2_grpc as rpc
except ImportError as exc:  # pragma: no cover - depends on the install step, not on the code
    raise ImportError(
        "inferd's gRPC stubs are missing (src/inferd/grpc/_gen/): they are generated at install time; run "
        "`python -m inferd.grpc.build` (make install does)") from exc

SERVICES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())
_SERVICE = "/inference.GRPCInferenceService/"


def _refused(exc: OIPError) -> Refused:
    return Refused(Code.NOT_FOUND if exc.status == 404 else Code.INVALID_ARGUMENT, exc.message)


def _parameter(value: Any) -> Any:
    which = value.WhichOneof("parameter_choice")
    return getattr(value, which) if which else None


def _texts(tensor: Any, raw: bytes | None) -> list[str]:
    """An input tensor's texts: its raw contents, or its ``bytes_contents`` as UTF-8 texts."""
    shape = list(tensor.shape)
    if raw is not None:
        return tensor_texts(tensor.name, tensor.datatype, shape, raw=raw)
    data = []
    for i, element in enumerate(tensor.contents.bytes_contents):
        try:
            data.append(element.decode("utf-8"))
        except UnicodeDecodeError:
            raise OIPError(f"input {tensor.name[:40]!r}: element {i} is not UTF-8 text") from None
    return tensor_texts(tensor.name, tensor.datatype, shape, data=data)


def infer_body(message: Any) -> InferBody:
    """A ModelInferRequest as the protocol's request (api/oip_tensors.py InferBody)."""
    raw = list(message.raw_input_contents)
    if raw and len(raw) != len(message.inputs):
        raise OIPError(f"raw_input_contents: {len(raw)} given for {len(message.inputs)} inputs; one each, or none")
    if not message.inputs:
        raise OIPError("inputs: must be a non-empty list of tensors")
    inputs: dict[str, list[str]] = {}
    for i, tensor in enumerate(message.inputs):
        if tensor.name in inputs:
            raise OIPError(f"inputs[{i}]: a second input named {tensor.name[:40]!r}")
        inputs[tensor.name] = _texts(tensor, raw[i] if raw else None)
    outputs = {o.name: True for o in message.outputs} or None
    parameters = {key: _parameter(value) for key, value in message.parameters.items()}
    return InferBody(message.id or None, parameters, inputs, outputs, True)


class OIPServicer(rpc.GRPCInferenceServiceServicer):
    def __init__(self, app: Any) -> None:
        self.app = app

    @unary(_SERVICE + "ServerLive")
    async def ServerLive(self, call: Call, message: Any) -> Any:  # noqa: N802 (the proto's method names)
        engine = call.s.engine
        return pb.ServerLiveResponse(live=engine.alive or engine.draining)

    @unary(_SERVICE + "ServerReady")
    async def ServerReady(self, call: Call, message: Any) -> Any:  # noqa: N802
        return pb.ServerReadyResponse(ready=readiness(call.request)[0] == 200)

    @unary(_SERVICE + "ServerMetadata")
    async def ServerMetadata(self, call: Call, message: Any) -> Any:  # noqa: N802
        return pb.ServerMetadataResponse(name="inferd", version=__version__, extensions=["binary_tensor_data"])

    @unary(_SERVICE + "ModelReady")
    async def ModelReady(self, call: Call, message: Any) -> Any:  # noqa: N802
        served = served_model(call.request, message.name)
        if readiness(call.request, served.name)[0] != 200:
            return pb.ModelReadyResponse(ready=False)
        check_version(served, message.version or None)
        return pb.ModelReadyResponse(ready=True)

    @unary(_SERVICE + "ModelMetadata")
    async def ModelMetadata(self, call: Call, message: Any) -> Any:  # noqa: N802
        try:
            served = served_model(call.request, message.name)
            check_version(served, message.version or None)
            _, signature = signature_of(served)
        except OIPError as exc:
            raise _refused(exc) from None
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=served.name, versions=versions_of(served), platform="inferd",
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in signature.inputs],
            outputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape)
                     for t in signature.outputs(description_of(served))])

    @unary(_SERVICE + "ModelInfer")
    async def ModelInfer(self, call: Call, message: Any) -> Any:  # noqa: N802
        try:
            planned = plan(call.request, infer_body(message), message.model_name, message.model_version or None)
        except OIPError as exc:
            raise _refused(exc) from None
        names = planned.signature.names
        # The call's deadline (grpc/call.py) unless the request's timeout parameter names one.
        result = await call.ask_engine(call.build(planned.inputs, names, **planned.options), names)
        head, chosen = planned.answer(result)
        out = pb.ModelInferResponse(model_name=head["model_name"], model_version=head["model_version"],
                                    id=head.get("id", ""))
        for tensor, _ in chosen:
            out.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            out.raw_output_contents.append(tensor.binary())
        return out


def oip_services(server: grpc.aio.Server, app: Any) -> Sequence[str]:
    """The Open Inference Protocol's service (package inference), for grpc/server.py's registrations."""
    rpc.add_GRPCInferenceServiceServicer_to_server(OIPServicer(app), server)
    return SERVICES
