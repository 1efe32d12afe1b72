"""What one model load is (``ModelDescription``), built once when it is loaded (core/slots.py) and never read from
the handler again, and its one rendering for the wire.

Every reader takes it from here: /info, /v1/models, the admin API, the metrics, a handler's reload rule
(``incompatibility``), the shadow report, and the routes, which shape an answer with the description that travels
with the result (core/outcomes.py TaskResult), so an answer computed by a canary is shaped by the canary's prompts,
normalisation and labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from inferd.core.capabilities import Capabilities
from inferd.core.tasks.kinds import task_of


def runtime_label(backend: str, dtype: str | None, quantize: str) -> str:
    """A runtime in one word, as responses' ``X-Inferd-Runtime`` and ``model.auto_candidates`` name it:
    ``openvino-bfloat16``, ``openvino-float32-int8``, ``torch-float32``."""
    return f"{backend}-{dtype or 'float32'}" + (f"-{quantize}" if quantize != "none" else "")


@dataclass(frozen=True, slots=True)
class TaskFacts:
    """What a handler says of the model it loaded (``Loaded.facts``): its task's facts, typed, which the load's
    description (core/slots.py ``describe_load``) takes as they are, once. ``other`` holds the task's other facts (an
    embedding's Dense layers and ``outputs``, a reranker's activation, a plug-in's own), kept as they are; one that
    names a fact of the load itself (its version, backend, ...) is not taken."""

    dimension: int | None = None
    normalize: bool | None = None
    pooling: str | None = None
    prompts: Mapping[str, str] | None = None
    default_prompt_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] | str | None = None  # sizes, "any", or None
    similarity_fn_name: str | None = None
    labels: tuple[str, ...] | None = None
    multi_label: bool = False
    other: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a handler's load found (``Handler.load`` returns it): the task's facts, and where and how its forward pass
    runs. The slot (core/slots.py) takes it once and builds the load's description from it; nothing reads these back
    from the handler. ``tokenizer`` is the fast tokenizer TEI's /tokenize and /decode and the long-document splitter
    use (None: the handler has none to show)."""

    facts: TaskFacts = field(default_factory=TaskFacts)
    max_seq_length: int | None = None
    device: str = ""  # where the weights are ("": not said)
    dtype: str | None = None
    backend: str = "torch"  # the runtime the forward pass runs on, as /info shows it
    quantize: str = "none"
    backend_info: Mapping[str, Any] | None = None
    capabilities: Capabilities = field(default_factory=Capabilities)
    tokenizer: Tokenizer | None = None


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """One load's facts. ``prompts`` is None for a task without prompts; ``facts`` holds the task's other facts
    (an embedding's Dense layers, a reranker's activation, a plug-in's own), kept as they are."""

    name: str
    version: str
    load_id: int
    path: str
    task: str
    dimension: int | None = None
    normalize: bool | None = None
    pooling: str | None = None
    prompts: Mapping[str, str] | None = None
    default_prompt_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] | str | None = None  # sizes, "any", or None
    similarity_fn_name: str | None = None
    labels: tuple[str, ...] | None = None
    multi_label: bool = False
    max_seq_length: int | None = None
    device: str = ""
    dtype: str | None = None
    backend: str = "torch"
    quantize: str = "none"
    backend_info: Mapping[str, Any] | None = None
    load_seconds: float = 0.0
    facts: Mapping[str, Any] = field(default_factory=dict)

    @property
    def runtime(self) -> str:
        """Which runtime computed this load's answers (``runtime_label``)."""
        return runtime_label(self.backend, self.dtype, self.quantize)

    def wire(self) -> dict[str, Any]:
        """The description as the wire shows it (/info's ``models``, the admin API pick from it): JSON types, and
        not the folder's ``path``, which only the admin API shows."""
        matryoshka = self.matryoshka_dimensions
        return {"name": self.name, "version": self.version, "task": self.task,
                "labels": None if self.labels is None else list(self.labels), "dimension": self.dimension,
                "max_seq_length": self.max_seq_length, "device": self.device, "dtype": self.dtype,
                "pooling": self.pooling, "normalize": self.normalize, "load_seconds": self.load_seconds,
                "backend": self.backend, "quantize": self.quantize, "runtime": self.runtime,
                "backend_info": None if self.backend_info is None else dict(self.backend_info),
                "matryoshka_dimensions": list(matryoshka) if isinstance(matryoshka, tuple) else matryoshka,
                "prompts": None if self.prompts is None else dict(self.prompts),
                "default_prompt_name": self.default_prompt_name, "similarity_fn_name": self.similarity_fn_name,
                "outputs": self.outputs}

    @property
    def outputs(self) -> list[str] | None:
        """An embedding model's outputs (dense, sparse, multivector: its handler's ``outputs``, a dense vector when
        it names none); None for a task without outputs."""
        return task_of(self.task).outputs(self.facts)
