"""Running the app under uvicorn, with a drain on SIGTERM/SIGINT before the listener closes.

uvicorn's own handling stops accepting connections at once; a load balancer still sending traffic would
see refused connections. Here the first signal turns readiness to 503 ("draining"), refuses new inference
with 503 + Retry-After, waits for accepted work (up to ``server.drain_timeout_s``), then stops.

SIGHUP re-reads the configuration and hot-reloads its model section (path, version, ...), exactly as
``POST /admin/models/reload`` would; the outcome is logged and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from inferd.config import ConfigError, Settings, load_settings
from inferd.core.handler import ModelLoadError
from inferd.core.model_loader import ModelNotReady, ReloadInProgress

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[bool]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.followers: list[uvicorn.Server] = []

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit and the process would die
        # by the signal instead of exiting 0 after a clean drain.
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


class FollowerServer(uvicorn.Server):
    """A second listener (the admin port) that stops with the leader and forwards signals to it."""

    def __init__(self, config: uvicorn.Config, leader: DrainingServer) -> None:
        super().__init__(config)
        self.leader = leader

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.leader.handle_exit(sig, frame)


async def reload_from_config(app: Any, reread: Callable[[], Settings]) -> str:
    """SIGHUP: read the configuration again and serve its model; returns the outcome label."""
    manager, metrics = app.state.manager, app.state.metrics
    try:
        fresh = reread()
        slot = await asyncio.to_thread(manager.reload_from_settings, fresh)
    except ReloadInProgress:
        log.warning("SIGHUP: another model change is in progress; nothing reloaded")
        outcome = "conflict"
    except ModelNotReady as exc:
        log.warning("SIGHUP: no model is serving yet (%s); nothing reloaded", exc.state)
        return "not_ready"
    except (ConfigError, ModelLoadError) as exc:
        log.error("SIGHUP reload failed; the serving model is unchanged: %s", exc)
        outcome = "failed"
    else:
        log.info("SIGHUP: now serving %s@%s", slot.spec.name, slot.version,
                 extra={"version": slot.version, "path": str(slot.spec.path)})
        outcome = "ok"
    metrics.model_reloads.labels(outcome).inc()
    return outcome


def _install_sighup(loop: asyncio.AbstractEventLoop, app: Any, reread: Callable[[], Settings]) -> None:
    tasks: set[asyncio.Task[str]] = set()

    def on_sighup() -> None:
        log.info("SIGHUP received: re-reading the configuration's model section")
        task = loop.create_task(reload_from_config(app, reread))
        tasks.add(task)  # a reference, or the task could be collected mid-reload
        task.add_done_callback(tasks.discard)

    with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP on Windows
        loop.add_signal_handler(signal.SIGHUP, on_sighup)


def serve(settings: Settings, reread: Callable[[], Settings] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; ``reread`` rebuilds the settings on SIGHUP (the CLI passes its flags)."""
    from inferd.api.app import create_admin_app, create_app
    from inferd.core.memory import configure_process
    from inferd.utils.logger import configure_logging

    configure_logging(settings.server.log_level, settings.server.log_format)
    guard = configure_process(settings)
    app = create_app(settings, memory_guard=guard)
    common: dict[str, Any] = {"log_config": None, "access_log": False,
                              "timeout_graceful_shutdown": int(settings.server.drain_timeout_s) + 5}
    leader = DrainingServer(
        uvicorn.Config(app, host=settings.server.host, port=settings.server.port, lifespan="on", **common),
        drain=lambda: app.state.engine.drain(settings.server.drain_timeout_s))
    servers: list[uvicorn.Server] = [leader]
    if settings.server.admin_port is not None:
        admin = uvicorn.Config(create_admin_app(app), host="127.0.0.1", port=settings.server.admin_port,
                               lifespan="off", **common)
        leader.followers.append(FollowerServer(admin, leader))
        servers += leader.followers

    async def serve_all() -> None:
        _install_sighup(asyncio.get_running_loop(), app, reread or (lambda: load_settings(settings.env)))
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(serve_all())
    return 0 if leader.started else 3
