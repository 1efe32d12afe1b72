"""The models one server serves: each with its own lifecycle (a ModelManager), batching rules, cache and queue
lane, found by the name clients send as ``model``.

A request names a model (``name``, or ``name@version`` to pin a version), or names none and gets its route's
task's default model: the one marked ``default``, else the task's first. A name that is not served, or one of
another task, is refused with the names that are (404 ``model_not_found``); a route whose task no model
serves is refused as before (404 ``wrong_task``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from inferd.core.batcher import Policy
from inferd.core.cache import ResultCache
from inferd.core.manager import ModelManager
from inferd.settings import ModelEntry, Settings


@dataclass(eq=False)
class ServedModel:
    entry: ModelEntry
    # The server's settings as this model sees them (Settings.for_model): its model, batching, cache, canary.
    settings: Settings
    manager: ModelManager
    policy: Policy
    cache: ResultCache | None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def task(self) -> str | None:
        return self.manager.task

    @property
    def required(self) -> bool:
        return self.entry.required


class ModelNotFound(Exception):
    """The request's ``model`` is not served (for its route's task); the message names what is."""

    def __init__(self, message: str, task_served: bool = True) -> None:
        super().__init__(message)
        self.message = message
        # False: the route's task has no model here at all (the route itself is the wrong one).
        self.task_served = task_served


def _listing(models: list[ServedModel]) -> str:
    return ", ".join(f"{m.name} ({m.task or 'task unknown'})" for m in models) or "none"


class ModelRegistry:
    """Name -> ServedModel, in configuration order. Changed on the event loop (start, SIGHUP); read anywhere."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self._lock = threading.Lock()

    def add(self, served: ServedModel) -> None:
        with self._lock:
            self._models[served.name] = served

    def remove(self, name: str) -> ServedModel | None:
        with self._lock:
            return self._models.pop(name, None)

    def get(self, name: str) -> ServedModel | None:
        """A served model by its name or one of its aliases (``models.<name>.aliases``)."""
        found = self._models.get(name)
        if found is None:
            found = next((m for m in list(self._models.values()) if name in m.entry.aliases), None)
        return found

    def __iter__(self) -> Iterator[ServedModel]:
        with self._lock:
            return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    def names(self) -> list[str]:
        return list(self._models)

    def first(self) -> ServedModel | None:
        """The server's default model: the first marked ``default``, else the first configured."""
        models = list(self)
        return next((m for m in models if m.entry.default), models[0] if models else None)

    def of_task(self, task: str) -> list[ServedModel]:
        return [m for m in self if m.task == task]

    def default_for(self, task: str | None) -> ServedModel | None:
        if task is None:
            return self.first()
        models = self.of_task(task)
        return next((m for m in models if m.entry.default), models[0] if models else None)

    def resolve(self, requested: str | None, task: str | None) -> tuple[ServedModel, str | None]:
        """The model a request runs on and the version pin to hand its manager (None: its routing decides).

        ``requested`` is the request's ``model``: a served name, ``name@version``, or (as a single-model server
        always took it) a version of the task's default model; ``task`` is the route's (None: any).
        """
        if requested:
            name, at, version = requested.partition("@")
            served = self.get(name)
            if served is not None:
                if task is not None and served.task not in (task, None):
                    raise ModelNotFound(f"model {name!r} is a {served.task} model, not a {task} model; "
                                        f"the {task} models served here: {self._names(task)}")
                versions = [slot.version for _, slot in served.manager.slots()]
                if at and versions and version not in versions:
                    raise ModelNotFound(f"model {name!r} serves version {' and '.join(versions)}, not "
                                        f"{version!r}")
                return served, requested if at else None
            fallback = self.default_for(task)
            if fallback is not None and not at and any(s.version == requested for _, s in fallback.manager.slots()):
                return fallback, requested
            what = f"{task} models" if task else "models"
            raise ModelNotFound(f"model {requested!r} is not served here; the {what} served: "
                                f"{self._names(task) if task else _listing(list(self))}")
        served = self.default_for(task)
        if served is None:
            raise ModelNotFound(f"no {task} model is served here; the models served: {_listing(list(self))}",
                                task_served=False)
        return served, None

    def _names(self, task: str) -> str:
        return ", ".join(m.name for m in self.of_task(task)) or "none"
