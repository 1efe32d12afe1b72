"""The models one server serves: each with its own lifecycle (a ModelManager), batching rules, cache and queue
lane, found by the name clients send as ``model``.

A request names a model (``name``, or ``name@version`` to pin a version), or names none and gets its route's
task's default model: the one marked ``default``, else the task's first. A name that is not served, or one of
another task, is refused with the names that are (MODEL_NOT_FOUND); a route whose task no model serves is
refused as such (WRONG_TASK). Routes read what they need before a request (``require_task``, ``task_of``) here,
never a model's manager or slots. A refusal to a tenant restricted to some models (core/tenant.py) names only those,
as /v1/models lists only those (api/catalog.py visible): the names another tenant is served are not its business.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from inferd.core.cache import ResultCache
from inferd.core.errors import EngineError, Kind, excerpt
from inferd.core.manager import ModelManager
from inferd.core.scheduler import Policy
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


def _listing(models: list[ServedModel]) -> str:
    return ", ".join(f"{m.name} ({m.task or 'task unknown'})" for m in models) or "none"


# A request's model and the version pinned on its manager (None: its routing decides), as ``resolve`` gives them.
Resolved = tuple[ServedModel, str | None]


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

    def tasks(self) -> list[str | None]:
        """The task of each served model, in order (None: not known until it loads)."""
        return [m.task for m in self]

    def require_task(self, task: str) -> None:
        """Refuses (WRONG_TASK) a route of a task no model here serves, naming the tasks served."""
        tasks = self.tasks()
        if task not in tasks and None not in tasks:
            served = ", ".join(dict.fromkeys(t for t in tasks if t)) or "no"
            raise EngineError(Kind.WRONG_TASK, f"this route serves the {task} task; this server serves the "
                              f"{served} task", "wrong_task")

    def task_of(self, requested: str | None) -> str | None:
        """The task of the model ``requested`` names (None: the server's default model), None while unknown."""
        name, at, version = (requested or "").partition("@")
        return self.resolve(name or None, None, version=version if at else None)[0].task

    def resolve(self, name: str | None, task: str | None, *, version: str | None = None,
                allowed: Collection[str] = ()) -> Resolved:
        """The model a request runs on and the version to pin on its manager (None: its routing decides);
        refuses (MODEL_NOT_FOUND, WRONG_TASK) with the names that are served.

        ``name`` is a served name, or (as a single-model server always took it) a version of the task's default
        model; ``version`` a version of the named model; ``task`` is the route's (None: any). ``allowed``: the
        served names the request's tenant may call (empty: every one), the only ones a refusal lists.
        """
        if name:
            served = self.get(name)
            if served is not None:
                if task is not None and served.task not in (task, None):
                    raise _not_found(f"model {name!r} is a {served.task} model, not a {task} model; "
                                     f"the {task} models served here: {self._names(task, allowed)}")
                versions = [slot.version for _, slot in served.manager.slots()]
                if version is not None and versions and version not in versions:
                    raise _not_found(f"model {name!r} serves version {' and '.join(versions)}, not "
                                     f"{excerpt(version)!r}")
                return served, version
            fallback = self.default_for(task)
            if fallback is not None and version is None and any(s.version == name
                                                                for _, s in fallback.manager.slots()):
                return fallback, name
            what = f"{task} models" if task else "models"
            # Quoted in part: the name is the client's, as long as its body allowed (a megabyte).
            requested = excerpt(name if version is None else f"{name}@{version}")
            raise _not_found(f"model {requested!r} is not served here; the {what} served: "
                             f"{self._names(task, allowed) if task else _listing(self._shown(allowed))}")
        served = self.default_for(task)
        if served is None:
            raise ModelNotFound(Kind.WRONG_TASK, f"no {task} model is served here; the models served: "
                                f"{_listing(self._shown(allowed))}")
        return served, None

    def _shown(self, allowed: Collection[str]) -> list[ServedModel]:
        """The served models a refusal may name to a tenant that may call ``allowed`` (empty: every one)."""
        return [m for m in self if not allowed or m.name in allowed]

    def _names(self, task: str, allowed: Collection[str] = ()) -> str:
        return ", ".join(m.name for m in self._shown(allowed) if m.task == task) or "none"


class ModelNotFound(EngineError):
    """No served model answers the request's ``model`` (MODEL_NOT_FOUND) or its route's task (WRONG_TASK)."""


def _not_found(message: str) -> EngineError:
    return ModelNotFound(Kind.MODEL_NOT_FOUND, message, field="model")
