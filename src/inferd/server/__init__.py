"""Running the app under uvicorn, with a drain on SIGTERM/SIGINT before the listener closes.

uvicorn's own handling stops accepting connections at once; a load balancer still sending traffic would
see refused connections. Here the first signal turns readiness to 503 ("draining"), refuses new inference
with 503 + Retry-After, waits for accepted work (up to ``server.drain_timeout_s``), then stops.

The whole shutdown fits in ``server.drain_timeout_s + SHUTDOWN_MARGIN_S``, the figure a Kubernetes grace
period (or ``docker stop --time``) must allow: after the drain, connections get ``CLOSE_S`` to finish
writing (every accepted request is answered by then; an upload still in progress is answered 503 by the
protocol), and a watchdog ends the process at the margin should the rest of the clean-up hang.

SIGHUP re-reads the configuration and serves its models: new ones are added, gone ones removed (after their
requests), and a model whose section changed (path, version, ...) is hot-reloaded exactly as
``POST /admin/models/reload`` would, its canary set or dropped as its ``canary:`` says; each model's outcome is
logged and counted. The tenants are taken again too. Every other section is read once at start (the listener,
logging, limits, memory, shadow lanes, jobs): a change to one is named in one warning, never applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from pydantic import BaseModel

from inferd.config import ConfigError, load_settings
from inferd.core.tenants import Tenancy
from inferd.settings import Settings

log = logging.getLogger(__name__)

# Seconds the shutdown may take beyond server.drain_timeout_s (docs/docker.md: the grace period).
SHUTDOWN_MARGIN_S = 5.0
# After the drain: how long open connections get to finish writing their (already computed) answers.
CLOSE_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[bool]],
                 drain_timeout_s: float = 30.0) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.followers: list[uvicorn.Server] = []
        self.drain_timeout_s = drain_timeout_s
        self.watchdog: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit and the process would die
        # by the signal instead of exiting 0 after a clean drain.
        self._arm_watchdog()
        if self._draining or self._loop is None:
            # A second signal (or one before start-up finished) stops now; a second SIGINT hard.
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self._stop()
            return
        self._draining = True
        log.info("%s received: draining before shutdown", signal.Signals(sig).name)
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_stop()))

    async def _drain_then_stop(self) -> None:
        completed = await self._drain()
        log.info("drained" if completed else "drain timed out; requests still queued were answered 503")
        self._stop()

    def _stop(self) -> None:
        self.should_exit = True
        for follower in self.followers:
            follower.should_exit = True

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _arm_watchdog(self) -> None:
        """From the first signal on, the process ends by drain_timeout_s + SHUTDOWN_MARGIN_S whatever hangs."""
        if self.watchdog is None:
            self.watchdog = threading.Timer(self.drain_timeout_s + SHUTDOWN_MARGIN_S - 0.5, _overran,
                                            args=(self.drain_timeout_s,))
            self.watchdog.daemon = True
            self.watchdog.start()


def _overran(drain_timeout_s: float) -> None:
    # Every accepted request was answered by the drain (or 503 at its timeout); what hangs is clean-up.
    log.error("shutdown overran server.drain_timeout_s (%g s) + %g s; exiting now", drain_timeout_s,
              SHUTDOWN_MARGIN_S)
    # Flushed as far as they can be: a stream closed under a handler (a pipe the supervisor dropped) must not keep
    # this thread from the exit it is for (CI caught it once: a handler's closed stream raised, nothing exited).
    for flush in [*(h.flush for h in (*logging.getLogger("inferd").handlers,
                                      *logging.getLogger("uvicorn").handlers)), sys.stdout.flush, sys.stderr.flush]:
        with contextlib.suppress(Exception):  # anything: the exit below is what matters
            flush()
    os._exit(0)


class FollowerServer(uvicorn.Server):
    """A second listener (the admin port) that stops with the leader and forwards signals to it."""

    def __init__(self, config: uvicorn.Config, leader: DrainingServer) -> None:
        super().__init__(config)
        self.leader = leader

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.leader.handle_exit(sig, frame)


# A model's SIGHUP outcome (InferenceEngine.reconfigure) as the reload counter's outcome label.
_OUTCOMES = {"added": "ok", "removed": "ok", "reloaded": "ok", "updated": "ok", "failed": "failed",
             "conflict": "conflict", "not_ready": "not_ready"}


# What a SIGHUP applies beside the models: each model's own sections are the engine's (InferenceEngine.reconfigure),
# and these keys of server: are the tenants' (_reload_tenants). Every other key is read once at start.
_MODEL_SECTIONS = frozenset({"model", "canary", "batching", "cache", "models"})
_TENANT_KEYS = frozenset({"tenants", "tenants_file", "api_keys", "tenant_limits_fraction"})


def restart_only(running: Settings, fresh: Settings) -> list[str]:
    """The keys ``fresh`` changes that only a restart applies, by dotted name (server.port, limits.max_...)."""
    names = []
    for section in Settings.model_fields:
        before, after = getattr(running, section), getattr(fresh, section)
        if section in _MODEL_SECTIONS or before == after:
            continue
        if not isinstance(before, BaseModel):
            names.append(section)
            continue
        names += [f"{section}.{key}" for key in type(before).model_fields
                  if getattr(before, key) != getattr(after, key)
                  and not (section == "server" and key in _TENANT_KEYS)]
    return names


async def reload_from_config(engine: Any, metrics: Any, reread: Callable[[], Settings],
                             tenancy: Tenancy | None = None) -> str:
    """SIGHUP: read the configuration again and serve its list of models (``engine.reconfigure``: models added,
    removed, changed) and its tenants; what only a restart applies is named in one warning. Returns the outcome
    label: ok, unchanged, or the worst of failed, conflict, not_ready (the models')."""
    try:
        fresh = reread()
        # Compared with the start's settings, which the engine keeps: unapplied, they are named at every SIGHUP.
        later = restart_only(engine.settings, fresh) + engine.start_only(fresh)
        if later:
            log.warning("SIGHUP: %s change only at a restart", ", ".join(later), extra={"restart_only": later})
        if tenancy is not None:
            _reload_tenants(tenancy, fresh)
        outcomes: dict[str, str] = await engine.reconfigure(fresh)
    except (ConfigError, OSError) as exc:
        # OSError: a configuration file that cannot be read (permissions, a half-written mount).
        log.error("SIGHUP reload failed; the served models are unchanged: %s", exc)
        outcomes = {"": "failed"}
    except Exception:
        # Nothing may escape into an unobserved task: that would only show as "never retrieved" at exit.
        log.exception("SIGHUP reload failed unexpectedly; the served models are unchanged")
        outcomes = {"": "failed"}
    labels = [_OUTCOMES[o] for o in outcomes.values() if o in _OUTCOMES]
    for label in labels:
        metrics.model_reloads.labels(label).inc()
    if outcomes and "" not in outcomes:
        log.info("SIGHUP: %s", ", ".join(f"{name} {o}" for name, o in outcomes.items()),
                 extra={"outcomes": outcomes})
    worst = next((w for w in ("failed", "conflict", "not_ready") if w in labels), None)
    return worst or ("ok" if labels else "unchanged")


def _reload_tenants(tenancy: Tenancy, fresh: Settings) -> None:
    """The tenants swap in one step on the loop: a request running keeps its tenant, a removed key is refused from
    the next request on. A tenants file that cannot be read leaves them as they were."""
    try:
        changes = tenancy.configure(fresh)
    except ValueError as exc:
        log.error("SIGHUP: the tenants are unchanged: %s", exc)
        return
    log.info("SIGHUP: tenants %s", ", ".join(changes) or "unchanged", extra={"tenants": sorted(tenancy.tenants)})


def _install_sighup(loop: asyncio.AbstractEventLoop, engine: Any, metrics: Any,
                    reread: Callable[[], Settings], tenancy: Tenancy | None = None) -> None:
    tasks: set[asyncio.Task[str]] = set()

    def on_sighup() -> None:
        log.info("SIGHUP received: re-reading the configuration's models")
        task = loop.create_task(reload_from_config(engine, metrics, reread, tenancy))
        tasks.add(task)  # a reference, or the task could be collected mid-reload
        task.add_done_callback(tasks.discard)

    with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP on Windows
        loop.add_signal_handler(signal.SIGHUP, on_sighup)


def serve(settings: Settings, reread: Callable[[], Settings] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; ``reread`` rebuilds the settings on SIGHUP (the CLI passes its flags)."""
    from inferd.api.app import create_admin_app, create_app, route_paths
    from inferd.api.middleware import RequestContextMiddleware, overloaded
    from inferd.api.services import services_of
    from inferd.core.memory import configure_process
    from inferd.server.http import ConnectionLimits, protocol_class
    from inferd.utils.logger import configure_logging
    from inferd.utils.trace_export import TracingConfigError, configure_tracing, shutdown_tracing

    configure_logging(settings.server.log_level, settings.server.log_format)
    try:
        configure_tracing()  # OTEL_*: off (nothing built) unless they name an exporter
    except TracingConfigError as exc:
        log.error("invalid tracing configuration: %s", exc)
        return 2
    guard = configure_process(settings)
    app = create_app(settings, memory_guard=guard)
    srv = settings.server
    limits = ConnectionLimits(srv.max_header_bytes, srv.header_timeout_s, srv.body_timeout_s,
                              srv.limit_concurrency)
    shared = services_of(app)
    metrics = shared.metrics

    def config(asgi: Any, host: str, port: int, lifespan: str, paths: frozenset[str]) -> uvicorn.Config:
        # Refused at the connection limit: counted under the path asked for, as the app counts its requests.
        busy = RequestContextMiddleware(overloaded, metrics=metrics, paths=paths, access=srv.access_log)
        return uvicorn.Config(
            asgi, host=host, port=port, lifespan=lifespan, log_config=None, access_log=False,
            http=protocol_class(limits, metrics, busy), ws="none", timeout_keep_alive=srv.keepalive_timeout_s,
            # Float seconds work (asyncio.wait_for); the type hint says int.
            timeout_graceful_shutdown=CLOSE_S)  # type: ignore[arg-type]

    leader = DrainingServer(config(app, srv.host, srv.port, "on", route_paths(settings)),
                            drain=lambda: shared.engine.drain(srv.drain_timeout_s),
                            drain_timeout_s=srv.drain_timeout_s)
    servers: list[uvicorn.Server] = [leader]
    if srv.admin_port is not None:
        admin = config(create_admin_app(app), "127.0.0.1", srv.admin_port, "off", route_paths(settings, admin=True))
        leader.followers.append(FollowerServer(admin, leader))
        servers += leader.followers

    async def serve_all() -> None:
        _install_sighup(asyncio.get_running_loop(), shared.engine, metrics,
                        reread or (lambda: load_settings(settings.env)), shared.tenancy)
        await asyncio.gather(*(s.serve() for s in servers))

    try:
        asyncio.run(serve_all())
    finally:
        shutdown_tracing()  # the last spans leave, within FLUSH_AT_EXIT_S
    return 0 if leader.started else 3
