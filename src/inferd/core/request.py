"""One inference request as the engine takes it: built once, validated once, then frozen.

Every wire API (api/openai.py, api/cohere.py, api/tei*.py, api/inferd_routes.py) translates its body into an
``InferenceRequest`` with ``InferenceRequest.build`` while it parses the body, so a refused body (a million texts,
a text of a megabyte) never outlives parsing, and hands it to ``engine.process``. ``build`` runs every rule that needs
no model, and is the only way to make one: admission trusts what it is given and checks only what depends on the
model that runs it (its task, the sizes it allows, its prompts, its queue and priority bounds).

A refusal is an ``EngineError`` of a kind, naming what is at fault: ``index`` the input (text or pair), ``field``
another field (``priority``); a pair's query is ``field="query"`` with the pair's ``index``. Each wire family
names them in its own words (api/errors.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from inferd.core.chunking import Chunking
from inferd.core.errors import EngineError, Kind, excerpt
from inferd.core.outputs import OUTPUTS
from inferd.core.preprocess import InputError, check_texts
from inferd.core.prompts import INPUT_TYPE_PROMPTS, Prompt
from inferd.core.tenant import Tenant
from inferd.core.text_options import PLAIN_INPUTS, InputOptions

# A text, or a (query, document) pair for a reranker; how each is encoded travels beside it (``text_options``).
Input: TypeAlias = "str | tuple[str, str]"

# The priorities a request may ask for; each model allows up to its batching.max_priority (checked at admission).
PRIORITIES = range(-100, 101)
# The longest deadline a request may set (10 minutes): past it a client has long given up.
MAX_TIMEOUT_MS = 600_000.0
# Input checks whose refusal is about length, not about the input's kind.
_TOO_LONG = frozenset({"context_length_exceeded", "too_many_tokens", "text_too_long", "too_many_token_vectors"})
# Only build() makes a request (dataclasses.replace() of a built one too: it passes the fields on).
_BUILT = object()


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's bounds on any request: ``limits.max_items_per_request`` and ``max_chars_per_text``, and the
    largest queue of any model (more items than that can never be queued, whichever model the request names)."""

    max_items: int
    max_chars: int
    max_queue: int
    # A text to be split into pieces (``chunking``) is a document, bounded by limits.max_document_chars instead.
    max_document_chars: int = 1_048_576


def input_refusal(exc: InputError) -> EngineError:
    """An input check's refusal as the engine's: a length is TOO_LONG, anything else INVALID_INPUT."""
    kind = Kind.TOO_LONG if exc.code in _TOO_LONG else Kind.INVALID_INPUT
    return EngineError(kind, exc.message, exc.code, index=exc.index)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What the engine runs: ``inputs`` (texts, or (query, document) pairs), the route's ``task`` (None: any),
    the ``model`` named (None: the task's default) and a ``version`` pinned (``name@version``), ``priority``
    (higher first), ``timeout_ms`` (None: the model's batching.default_timeout_ms), ``routing_key`` (a canary
    bucket), ``prompt`` (the choice, resolved on the model load that runs it; None: no prompt), ``dimensions``
    (an embedding size, cut from the model's own), ``calibrate`` (the result carries that load's int8/uint8
    calibration vectors).

    ``outputs`` are the kinds an embedding request wants (core/outputs.py OUTPUTS: dense, sparse, multivector;
    issue 32's sparse and multi-vector routes ask for more than the dense default) and ``tenant`` whose request
    it is (core/tenants.py: its allow-list, limits, budget and fair share apply; None: nobody's in particular),
    the one the route's key check found (api/security.py), set by the route as it builds the request.
    ``text_options`` say how each input is encoded beyond the model's settings (core/text_options.py: its cut side,
    truncate, max_tokens, role; of a pair, the document's): one value shared by every input, or one per input.
    """

    inputs: tuple[Input, ...]
    task: str | None = None
    model: str | None = None
    version: str | None = None
    priority: int = 0
    timeout_ms: float | None = None
    routing_key: str | None = None
    prompt: Prompt | None = None
    dimensions: int | None = None
    calibrate: bool = False
    outputs: tuple[str, ...] = ("dense",)
    tenant: Tenant | None = None
    # Texts longer than the model's window are split into pieces (core/pieces.py); None: each text is one input.
    chunking: Chunking | None = None
    text_options: InputOptions = PLAIN_INPUTS
    _built: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._built is not _BUILT:
            raise TypeError("an InferenceRequest is made by InferenceRequest.build, which validates it")

    @property
    def pairs(self) -> bool:
        return bool(self.inputs) and isinstance(self.inputs[0], tuple)

    @property
    def allowed_models(self) -> tuple[str, ...]:
        """The served names its tenant may call (empty: every one): a refusal of its ``model`` names only those
        (core/registry.py resolve)."""
        return self.tenant.rules.models if self.tenant is not None else ()

    @classmethod
    def build(cls, limits: Limits, inputs: Any, *, task: str | None = None, model: str | None = None,
              priority: int = 0, timeout_ms: float | None = None, routing_key: str | None = None,
              prompt: Prompt | None = None, dimensions: int | None = None, calibrate: bool = False,
              outputs: Sequence[str] = ("dense",), tenant: Tenant | None = None,
              chunking: Chunking | None = None, text_options: InputOptions = PLAIN_INPUTS) -> InferenceRequest:
        """The request, every model-free rule checked (raises EngineError); ``model`` may pin a version as
        ``name@version``."""
        if chunking is not None:
            chunking.check()
        checked = _inputs(inputs, limits if chunking is None else _documents(limits))
        if text_options.each is not None and len(text_options.each) != len(checked):
            raise ValueError(f"{len(text_options.each)} text options for {len(checked)} inputs")
        name, version = _model(model)
        _check_priority(priority)
        _check_timeout(timeout_ms)
        if dimensions is not None and (type(dimensions) is not int or dimensions <= 0):
            raise EngineError(Kind.INVALID_INPUT, f"must be a positive integer, not {dimensions!r}", "invalid_value",
                              field="dimensions")
        if prompt is not None:
            _check_prompt(prompt)
        kinds = tuple(outputs)
        wrong = next((k for k in kinds if k not in OUTPUTS), None)
        if not kinds or wrong is not None or len(set(kinds)) != len(kinds):
            raise EngineError(Kind.INVALID_INPUT, f"must be distinct output kinds of {list(OUTPUTS)}, not "
                              f"{list(kinds)}", "invalid_value", field="outputs")
        return cls(checked, task, name, version, priority, timeout_ms, routing_key, prompt, dimensions,
                   bool(calibrate), kinds, tenant, chunking, text_options, _BUILT)


def _inputs(inputs: Any, limits: Limits) -> tuple[Input, ...]:
    """Texts, or (query, document) pairs, each one item: counts, types, emptiness, lengths."""
    try:
        if not isinstance(inputs, list | tuple):
            raise InputError(None, f"must be a list of strings, not {type(inputs).__name__}", "invalid_type")
        if inputs and isinstance(inputs[0], tuple):
            _check_pairs(inputs, limits)
        else:
            check_texts(inputs, limits.max_items, limits.max_chars)
        if len(inputs) > limits.max_queue:
            # "Overloaded, retry" would promise a retry that can never fit in any model's queue.
            raise InputError(None, f"{len(inputs)} texts given; at most {limits.max_queue} (batching.max_queue) "
                             "per request", "too_many_items")
    except InputError as exc:
        raise input_refusal(exc) from None
    return tuple(inputs)


def _documents(limits: Limits) -> Limits:
    """The bounds of texts to be split: a document's characters instead of a short text's."""
    return Limits(limits.max_items, limits.max_document_chars, limits.max_queue, limits.max_document_chars)


def _check_pairs(pairs: Sequence[Any], limits: Limits) -> None:
    """Each pair's document is checked as a text, named by the pair's index; its query by ``field="query"``
    (a query shared by every pair, as /rerank sends it, is checked once)."""
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InputError(i, "must be a (query, document) pair, as every input of this request is",
                             "invalid_type")
    check_texts([d for _, d in pairs], limits.max_items, limits.max_chars)
    last: object = _BUILT  # no query is this object
    for i, (query, _) in enumerate(pairs):
        if query is last:
            continue
        last = query
        try:
            check_texts([query], 1, limits.max_chars)
        except InputError as exc:
            refusal = input_refusal(exc)
            refusal.index, refusal.field = i, "query"
            raise refusal from None


def _model(model: str | None) -> tuple[str | None, str | None]:
    if model is None:
        return None, None
    if not isinstance(model, str) or not model:
        raise EngineError(Kind.INVALID_INPUT, "must be a served model's name (GET /v1/models)", "invalid_value",
                          field="model")
    name, at, version = model.partition("@")
    if at and not (name and version):
        raise EngineError(Kind.INVALID_INPUT, f"{excerpt(model)!r} is not name@version", "invalid_value", field="model")
    return name, (version if at else None)


def _check_priority(priority: int) -> None:
    if type(priority) is not int or priority not in PRIORITIES:
        raise EngineError(Kind.INVALID_INPUT, f"must be an integer from {PRIORITIES.start} to {PRIORITIES.stop - 1}"
                          f", not {priority!r}", "invalid_value", field="priority")


def _check_timeout(timeout_ms: float | None) -> None:
    if timeout_ms is None:
        return
    if (isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float) or not math.isfinite(timeout_ms)
            or not 0 < timeout_ms <= MAX_TIMEOUT_MS):
        raise EngineError(Kind.INVALID_INPUT, f"must be a number of milliseconds above 0 and at most "
                          f"{MAX_TIMEOUT_MS:.0f}, not {timeout_ms!r}", "invalid_value", field="timeout_ms")


def _check_prompt(prompt: Prompt) -> None:
    """The prompt's name is looked up on the model that runs (core/prompts.py); here only its form."""
    if prompt.input_type is not None:
        if prompt.input_type not in INPUT_TYPE_PROMPTS:
            raise EngineError(Kind.INVALID_INPUT, f"{prompt.input_type!r} is not one of "
                              f"{list(INPUT_TYPE_PROMPTS)}", "invalid_value", field=prompt.field)
    elif prompt.name is not None and (not isinstance(prompt.name, str) or not prompt.name.strip()):
        raise EngineError(Kind.INVALID_INPUT, "must name one of the model's prompts", "unknown_prompt",
                          field=prompt.field)
