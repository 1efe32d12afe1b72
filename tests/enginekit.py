"""The in-process engine kit: an InferenceEngine over fake handlers (tests/fakes.py) with no HTTP and no weights, and
the one async wait for a condition (issue 40 item 5: the harness was built by hand in six suites, ``until`` written
six times).

- ``EngineKit(settings, load)``: the engine of these settings (tests/settingskit.make_settings), every served model
  that is not ``load_mode: lazy`` loaded at once, as the app loads them at start. ``load`` is a handler (that very
  instance at every load, fakes.loader_for), ``by_folder(handlers)`` (the handler named by the load's folder:
  several models, a reload, a canary or a shadow) or ``per_load(make)`` (a new handler made from each load's spec);
  any other ``spec -> Handler`` is taken as it is. ``guard`` is the memory guard, bound to the kit's metrics.
- ``kit.run(scenario)``: the engine started on a new event loop, ``scenario()`` awaited (``timeout`` seconds at
  most) and its value returned; then every gate (``hold:NAME``) of every handler the kit loaded is opened and the
  engine stopped, so a failing scenario never leaves a worker held for the fake's minute. Once a kit: a stopped
  engine does not start again, so tests do not share one (building one costs about 3 ms).
- ``kit.sample(metric, **labels)``: a metric's value (0.0 while unset).
- ``ask(engine, texts, **options)``: one request as a task; ``await hold(engine, handler, name)``: the worker held
  on a batch ``hold:NAME`` until ``handler.gates[name]`` is set. Both take any engine, an app's too.

``until`` polls a condition on the loop a scenario runs on until it is truthy and returns its value, failing with
an AssertionError that names ``what`` after ``timeout`` seconds; the condition may return an awaitable (a check
over HTTP), which is awaited. It takes conftest.wait_for's arguments, that wait's async twin (a test's own thread
polls with wait_for; conftest stays free of this module's torch import). It polls every 2 ms, an in-process
condition being cheap to read; a caller reading a server over HTTP passes a longer ``every``.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from fakes import HashHandler, loader_for

from inferd.core.engine import InferenceEngine, OnModelsChange
from inferd.core.memory import MemoryGuard
from inferd.core.outcomes import TaskResult
from inferd.core.spec import ModelSpec
from inferd.core.tasks.base import Handler
from inferd.settings import Settings
from inferd.utils.metrics import Metrics

T = TypeVar("T")
Loader = Callable[[ModelSpec], Handler]
CPU = torch.device("cpu")


async def until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition", *,
                every: float = 0.002) -> Any:
    """Poll ``condition()`` (awaited when it returns an awaitable) until truthy; its value, or fail naming ``what``."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > give_up:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(every)


def ask(engine: InferenceEngine, texts: Any, **options: Any) -> asyncio.Future[TaskResult]:
    """One request to the engine, as a task of the running loop."""
    return asyncio.ensure_future(engine.process(engine.request(texts, **options)))


async def hold(engine: InferenceEngine, handler: HashHandler, name: str, **options: Any) -> asyncio.Future[TaskResult]:
    """Occupy the worker with a batch ``hold:NAME`` that blocks until ``handler.gates[name]`` is set."""
    handler.gates[name] = threading.Event()
    held = ask(engine, [f"hold:{name}"], **options)
    await until(lambda: any(f"hold:{name}" in batch for batch in handler.batches), what=f"hold:{name} running")
    return held


def by_folder(handlers: Mapping[str, Handler]) -> Loader:
    """A loader: the handler named by the load's folder (its path's last part), loaded on the CPU."""

    def load(spec: ModelSpec) -> Handler:
        handler = handlers[Path(spec.path).name]
        handler.open(spec, CPU)
        return handler

    return load


def per_load(make: Callable[[ModelSpec], Handler]) -> Loader:
    """A loader: a new handler per load, made from its spec, loaded on the CPU."""

    def load(spec: ModelSpec) -> Handler:
        handler = make(spec)
        handler.open(spec, CPU)
        return handler

    return load


class EngineKit:
    """One in-process engine, the handlers it loaded, and a way to drive it; see the module's docstring."""

    def __init__(self, settings: Settings, load: Handler | Loader, *, guard: Any = None,
                 on_change: OnModelsChange | None = None,
                 on_lazy_failure: Callable[[str], None] | None = None) -> None:
        """``on_change`` and ``on_lazy_failure`` are handed to the engine as they are."""
        self.loaded: list[Handler] = []
        self._ran = False
        self._load = loader_for(load) if isinstance(load, Handler) else load
        self.metrics = Metrics(settings.batching.max_batch_size)
        if isinstance(guard, MemoryGuard):  # a suite's own fake guard has nothing to bind
            guard.bind(self.metrics)
        self.engine = InferenceEngine(settings, self.metrics, guard, loader=self._loading, on_change=on_change,
                                      on_lazy_failure=on_lazy_failure)
        for served in self.engine.registry:
            if served.settings.model.load_mode != "lazy":
                served.manager.load_initial()

    def _loading(self, spec: ModelSpec) -> Handler:
        handler = self._load(spec)
        self.loaded.append(handler)
        return handler

    def run(self, scenario: Callable[[], Awaitable[T]], timeout: float = 20.0) -> T:
        """Start the engine on a new loop, await ``scenario()`` and return its value; open every gate, stop."""
        # A stopped engine's workers do not start again (its requests would answer worker_dead): one run a kit.
        if self._ran:
            raise RuntimeError("this kit's engine has run and stopped: build another EngineKit")
        self._ran = True

        async def main() -> T:
            self.engine.start()
            try:
                return await asyncio.wait_for(scenario(), timeout)
            finally:
                for handler in self.loaded:
                    if isinstance(handler, HashHandler):
                        for gate in handler.gates.values():
                            gate.set()
                self.engine.stop()

        return asyncio.run(main())

    def sample(self, metric: str, **labels: str) -> float:
        """A metric's value in the kit's registry, 0.0 while unset (as an unset counter)."""
        return self.metrics.registry.get_sample_value(metric, labels) or 0.0
