"""The generated gRPC modules of proto/tei.proto, or an error that says how to make them.

They are generated at install time (``python -m inferd.grpc.build``, which ``make install`` and the Dockerfile
run), so a checkout that skipped the install step has none: importing this module then fails naming the command,
rather than with a bare ModuleNotFoundError from deep inside the server's start.
"""

from __future__ import annotations

try:
    from inferd.grpc._gen import tei_pb2 as pb
    from inferd.grpc._gen import tei_pb2_grpc as rpc
    from inferd.grpc._gen._pool import POOL
except ImportError as exc:  # pragma: no cover - depends on the install step, not on the code
    raise ImportError(
        "inferd's gRPC stubs are missing (src/inferd/grpc/_gen/): they are generated at install time; run "
        "`python -m inferd.grpc.build` (make install does)") from exc

# The proto's package and its services' full names (health and reflection list them).
PACKAGE = "tei.v1"
SERVICES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())

__all__ = ["PACKAGE", "POOL", "SERVICES", "pb", "rpc"]
