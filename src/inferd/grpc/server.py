"""The gRPC server: TEI's services (and any other family's, through ``registrations``), the standard health service
and server reflection, on ``server.grpc_port``, in the same process and event loop as HTTP (api/app.py's lifespan
starts it once the eager models have loaded and stops it before the engine's last drain).

A family adds its services with a registration: ``(server, app) -> the full names of the services it added``
(``tei_services`` is TEI's); one server serves them all, and health and reflection list every one.

Health follows /health/ready (api/health.py readiness): the server (``""``) and each service are SERVING while it
would answer 200 and NOT_SERVING otherwise (loading, a required model failed, draining), re-read every
``HEALTH_EVERY_S``; at the stop every service turns NOT_SERVING before the listener closes.

Messages are bounded by ``limits.max_body_bytes`` as HTTP bodies are: a larger one is refused RESOURCE_EXHAUSTED by
gRPC itself, before it is parsed; one that does not parse is refused INVALID_ARGUMENT (parsing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from starlette.requests import Request

from inferd.api.health import readiness
from inferd.api.services import services_of
from inferd.grpc.embed import EmbedServicer
from inferd.grpc.parsing import ParseMessages
from inferd.grpc.scores import PredictServicer, RerankServicer
from inferd.grpc.stubs import POOL, SERVICES, rpc
from inferd.grpc.tokens import InfoServicer, TokenizeServicer

log = logging.getLogger(__name__)

HEALTH_EVERY_S = 0.5
Registration = Callable[[grpc.aio.Server, Any], Sequence[str]]


def tei_services(server: grpc.aio.Server, app: Any) -> Sequence[str]:
    """text-embeddings-inference's services (package tei.v1)."""
    rpc.add_InfoServicer_to_server(InfoServicer(app), server)
    rpc.add_EmbedServicer_to_server(EmbedServicer(app), server)
    rpc.add_PredictServicer_to_server(PredictServicer(app), server)
    rpc.add_RerankServicer_to_server(RerankServicer(app), server)
    rpc.add_TokenizeServicer_to_server(TokenizeServicer(app), server)
    return SERVICES


def _reflected() -> Any:
    """inferd's own descriptor pool (grpc/build.py: its packages are tei-client's and tritonclient's too), holding the
    health and reflection services' files as well, so reflection describes every service it lists."""
    for module in (health_pb2, reflection_pb2):
        with contextlib.suppress(TypeError):  # already added by an earlier server in this process
            POOL.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return POOL


class GrpcServer:
    """Built by the lifespan; ``start`` binds and serves (returns the port bound: 0 asks for a free one), ``stop``
    refuses new calls and gives those running ``grace`` seconds."""

    def __init__(self, app: Any, registrations: Sequence[Registration] = (tei_services,)) -> None:
        self.app = app
        s = services_of(app)
        self.host, self.port = s.settings.server.host, s.settings.server.grpc_port
        limit = s.settings.limits.max_body_bytes
        self.server = grpc.aio.server(interceptors=[ParseMessages()],
                                      options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)])
        names: list[str] = []
        for register in registrations:
            names += register(self.server, app)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.names = ("", *names)
        reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server,
                                            pool=_reflected())
        self._watch: asyncio.Task[None] | None = None
        self._serving: bool | None = None

    async def start(self) -> int:
        port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"gRPC: cannot listen on {self.host}:{self.port} (server.grpc_port)")
        await self.server.start()
        await self._publish()
        self._watch = asyncio.create_task(self._follow())
        log.info("gRPC listening on %s:%d (%s)", self.host, port, ", ".join(n for n in self.names if n))
        return port

    async def stop(self, grace: float) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    def _ready(self) -> bool:
        status, _ = readiness(Request({"type": "http", "app": self.app, "headers": [], "query_string": b""}))
        return status == 200

    async def _publish(self) -> None:
        ready = self._ready()
        if ready is self._serving:
            return
        self._serving = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.health.set(name, status)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            try:
                await self._publish()
            except Exception:  # a readiness read must never end the health service's updates
                log.exception("gRPC health: readiness could not be read")
