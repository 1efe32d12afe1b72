"""What a task is, apart from how a model runs it: the ``Task`` every task object derives from, and the ``Output``
an embedding may give beyond its dense vector. One object per task (``*_task.py``), registered in ``kinds.py`` and
chosen once by name (``kinds.task_of``); the gate, the drift report, admission and the description call its members
and never branch on the name (sentence-transformers' SimilarityFunction: one table, no ladder at the call sites;
vLLM's pooler per task, chosen once).

Numpy only (core/agreement.py's measures, core/errors.py's refusals): the fleet's CLI holds reports to these bounds
without torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.core.agreement import Bound
from inferd.core.errors import EngineError, Kind
from inferd.core.tasks.drift import Drift, Worst

if TYPE_CHECKING:  # the description reads the task objects (its outputs): a type only, never imported at run time
    from inferd.core.description import ModelDescription


class Output(ABC):
    """One kind of answer an embedding model may give for a text (a dense vector, a sparse vector, token
    vectors): the gate figure that says it was measured, and the bounds its figures are held to."""

    name: str
    # The gate's figure present (not None) exactly when the model gives this output.
    lead_figure: str

    @abstractmethod
    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        """The bounds of this output's figures at precision ``kind`` (fp32, half, int8); ``gate``: model.gate."""

    @abstractmethod
    def cosines(self, reference: list[Any], got: list[Any]) -> np.ndarray:
        """The cosines of two models' values of this output (one per input, in order): the gate's cosine figures
        when it is the first output the model gives."""

    @abstractmethod
    def figures(self, reference: list[Any], got: list[Any], ranked: bool) -> dict[str, float | None]:
        """This output's own gate figures over two models' values (``ranked``: enough inputs for neighbours)."""


class Task(ABC):
    """One task's knowledge. The defaults are those of a task whose answers are scores per input (a plug-in's own
    task is compared so)."""

    name: str
    # Clients store its answers (vectors) and compare them with later ones: a new model is held to the serving
    # one's dimension (``model.allow_dimension_change``) and a canary to its space (core/space_check.py).
    stored_vectors: bool = False
    # The accuracy gate compares its answers as vectors (cosine, neighbours) rather than as scores.
    gate_vectors: bool = False
    # The query the gate's padding document is paired with (None: its inputs are texts, not pairs).
    gate_query: str | None = None
    # What the gate's set counts, as its summary says.
    unit: str = "texts"
    # Its inputs are (query, document) pairs rather than texts (a route that takes either by the model's task
    # asks this: inferd's /predict, TEI's /predict).
    takes_pairs: bool = False

    @abstractmethod
    def bounds(self, kind: str, gate: Any) -> list[Bound]:
        """The bounds a model's figures are held to at precision ``kind`` (fp32, half, int8), ``gate`` being the
        model.gate settings: agreement bounds are the task's whatever the precision; a difference's bound
        (``upper``) is the precision's."""

    @abstractmethod
    def drift(self, worst: Worst, labels: Sequence[str] | None, multi_label: bool, window: int,
              neighbours: int) -> Drift:
        """A new comparison of a candidate's answers with the active model's, for a drift report."""

    # -- a request's task options ---------------------------------------------------------------------------

    def refusal(self, description: ModelDescription, dimensions: int | None,
                outputs: tuple[str, ...]) -> EngineError | None:
        """Why the load ``description`` describes cannot answer a request's task options (None: it can):
        ``dimensions`` its vectors' size (a model that declares no dimension takes any), ``outputs`` the kinds of
        an embedding asked (a task without outputs ignores them)."""
        return None if dimensions is None else wrong_dimensions(description, dimensions)

    # -- the accuracy gate --------------------------------------------------------------------------------

    def gate_inputs(self, texts: Sequence[str]) -> list[Any]:
        """What the gate runs the task on, made from its texts."""
        return list(texts)

    def gate_scores(self, out: np.ndarray) -> np.ndarray:
        """The part of a forward pass's rows the gate compares (a reranker's [score, raw] rows: the score)."""
        return out

    def gate_span(self, reference: np.ndarray) -> float:
        """The scale a score difference is a share of (1: the scores' own, probabilities)."""
        return 1.0

    def gate_figures(self, reference: np.ndarray, got: np.ndarray, multi_label: bool) -> dict[str, float]:
        """One batch shape's figures for scores (``gate_vectors`` tasks are measured as vectors instead)."""
        return {}

    # -- the description -----------------------------------------------------------------------------------

    def facts(self, dimension: int | None) -> dict[str, Any]:
        """What a loaded model of this task tells its description by default (a handler may say more)."""
        return {}

    def outputs(self, facts: Mapping[str, Any]) -> list[str] | None:
        """The outputs a model of this task gives (its handler's ``outputs`` fact); None: it has no outputs."""
        return None


def wrong_dimensions(description: ModelDescription, dimensions: int) -> EngineError | None:
    """``dimensions`` (OpenAI's, TEI's; Cohere's output_dimension) the model cannot give: its own size, or a
    smaller one its description allows (``matryoshka_dimensions``: sizes, or ``any``); the routes cut the
    vectors (core/quantize.py), so the result cache keeps full vectors."""
    dimension = description.dimension
    if dimension is None or dimensions == dimension:
        return None
    allowed = description.matryoshka_dimensions
    if (allowed == "any" and 0 < dimensions < dimension) or (isinstance(allowed, tuple) and dimensions in allowed):
        return None
    if allowed == "any":
        also = f", or any size from 1 to {dimension} (Matryoshka)"
    elif isinstance(allowed, tuple) and [d for d in allowed if d != dimension]:
        also = f", or one of {[d for d in allowed if d != dimension]} (Matryoshka)"
    else:
        also = " (it declares no Matryoshka sizes: model.matryoshka_dimensions)"
    return EngineError(Kind.INVALID_INPUT, f"this model produces {dimension}-dimensional embeddings{also}; "
                       f"{dimensions} was asked", field="dimensions")
