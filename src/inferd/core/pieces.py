"""Long documents: a request's texts split into pieces that fit the model (core/chunking.py), the pieces run as
ordinary inputs, and each document's answer merged back from its pieces' (core/tasks/piece_merge.py).

The pieces go through admission like any request's texts (core/admission.py): the result cache answers each
piece it holds, a tenant's budget is charged every piece's tokens, the queue orders them by the request's priority
and drops them at its deadline, and the scheduler batches them under the model's batching rules, so a document
of ten thousand pieces runs in as many batches as the rules allow, never one. They are queued in waves of at most
one batch (``wave_plan``), two waves at a time, together at most the model's queue: the queue holds the next wave
while the current one runs, and other requests' texts queue behind at most two batches of a document.

A document is split on the tokenizer of the model load that runs its pieces (they are pinned to it), with room
kept for that load's special tokens and prompt. The answer of each document is either its pieces merged (mode
``pooled``: the same type as a short text's answer, so every route shapes it unchanged) or ``DocumentPieces``:
each piece's span, token count and answer, beside the pooled one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from inferd.core import late_chunking, long_rerank
from inferd.core.admission import Admission
from inferd.core.chunking import LATE, Chunking, Piece, backend, split_within
from inferd.core.errors import EngineError, Kind, deadline_passed
from inferd.core.outcomes import TaskResult, merged_timings
from inferd.core.outputs import token_vectors_refusal
from inferd.core.prompts import prompt_text
from inferd.core.registry import ModelRegistry, Resolved, ServedModel
from inferd.core.request import InferenceRequest
from inferd.core.slots import ModelSlot
from inferd.core.tasks.base import TokenVectorTask
from inferd.core.tasks.embedding_task import MULTIVECTOR, TOKEN_STATES
from inferd.core.tasks.kinds import task_of
from inferd.core.tasks.piece_merge import merge, mergeable
from inferd.settings import LimitSettings

# Pieces queued at once per wave: at most one full batch of the model's (batching.max_batch_size), two waves in
# flight, so the worker always has the next batch of a document queued while one runs, and a short request that
# arrives meanwhile waits behind at most two batches of it rather than the whole document: with waves of 256,
# bench/long_docs.py measured short requests beside a stream of 10,000-token documents waiting for their waves.
PIECES_PER_WAVE = 256
WAVES_IN_FLIGHT = 2


def wave_plan(batching: Any) -> tuple[int, int]:
    """(pieces per wave, waves in flight) for a model's batching rules: the waves in flight together fit its queue
    (a full queue would refuse the next one)."""
    in_flight = min(WAVES_IN_FLIGHT, batching.max_queue)
    return max(1, min(PIECES_PER_WAVE, batching.max_batch_size, batching.max_queue // in_flight)), in_flight


@dataclass(frozen=True, eq=False)
class DocumentPieces:
    """One document's answer in mode ``pieces``: its ``pieces`` (spans into the text, token counts), each
    piece's answer in ``outputs`` (in order) and the document's ``pooled`` answer."""

    pieces: list[Piece]
    outputs: list[Any]
    pooled: Any


def special_tokens(tokenizer: Any) -> int:
    """The tokens the tokenizer adds around one text ([CLS] ... [SEP]: 2)."""
    processor = backend(tokenizer).post_processor
    return 0 if processor is None else int(processor.num_special_tokens_to_add(False))


class Documents:
    def __init__(self, admission: Admission, registry: ModelRegistry, limits: LimitSettings) -> None:
        self.admission = admission
        self.registry = registry
        self.limits = limits
        # Splitting a megabyte takes a core for a second or more: off the event loop, this many at a time.
        self._threads = asyncio.Semaphore(limits.preprocess_concurrency)

    def with_default(self, request: InferenceRequest, resolved: Resolved | None) -> InferenceRequest:
        """``request`` with its model's default chunking (model.chunking) when it asks none itself; ``resolved``:
        the request's model as the registry resolved it (None: no served model; admission refuses it). A request
        that says how its long texts are cut (Cohere's ``truncate`` END, START or NONE, TEI's ``truncate``, a
        ``max_tokens``) asked for that, not for the model's default: it is cut, or refused, as it asked."""
        if resolved is None or request.chunking is not None or request.pairs or not mergeable(request.outputs):
            return request
        default = resolved[0].settings.model.chunking
        if default is None:
            return request
        options = request.text_options.per_text(len(request.inputs))
        if any(o.truncate is not None or o.max_tokens is not None for o in options):
            return request
        chunking = Chunking(default.mode, default.max_tokens, default.overlap).check()
        return dataclasses.replace(request, chunking=chunking)

    async def serve_pieces(self, request: InferenceRequest, disconnected: Callable[[], Awaitable[Any]] | None,
                           resolved: Resolved | None = None) -> TaskResult:
        """``request``'s texts (``request.chunking`` set) split, run as pieces, merged back per document; ``resolved``:
        its model as the engine resolved it (None: resolved here, which gives the refusal)."""
        chunking = request.chunking
        assert chunking is not None
        refused = long_rerank.refusal(chunking) if request.pairs else None
        if refused is not None:
            raise refused
        if not request.pairs and chunking.mode in long_rerank.MODES:
            raise EngineError(Kind.INVALID_INPUT, f"chunking mode {chunking.mode!r} scores (query, document) pairs; "
                              "texts are embedded pooled, by pieces or late", "invalid_value", field="chunking.mode")
        with self.admission.whole_request():  # a drain lets every wave run (within its time)
            return await self._serve_accepted(request, disconnected, resolved)

    async def _serve_accepted(self, request: InferenceRequest, disconnected: Callable[[], Awaitable[Any]] | None,
                              resolved: Resolved | None) -> TaskResult:
        """``serve_pieces`` once the request is accepted (counted by the drain)."""
        served, pin = resolved or self.registry.resolve(request.model, request.task, version=request.version,
                                                        allowed=request.allowed_models)
        tenant = request.tenant
        if tenant is None:
            return await self._serve_split(served, pin, request, disconnected)
        # The tenant is admitted once for the whole request (its request rate and concurrency count requests, not
        # waves; a second wave would take a second place of its max_concurrent), and first: before its model is
        # loaded (lazy mode) or its documents split, in places every tenant shares (limits.preprocess_concurrency),
        # which a request its limits refuse must not hold. Every wave charges its pieces' tokens to its budget.
        priority = tenant.admit(served.name, request.priority)
        try:
            return await self._serve_split(served, pin, dataclasses.replace(request, priority=priority), disconnected)
        finally:
            tenant.leave()

    async def _serve_split(self, served: ServedModel, pin: str | None, request: InferenceRequest,
                           disconnected: Callable[[], Awaitable[Any]] | None) -> TaskResult:
        """``serve_pieces`` once its tenant (if any) is admitted."""
        chunking = request.chunking
        assert chunking is not None
        started = time.monotonic()
        async with self.admission.hold(served.name if pin is None else f"{served.name}@{pin}",
                                       request.task) as slot:
            if request.pairs:
                return await self._rerank(request, served.settings.batching, slot, started, disconnected)
            late = chunking.mode == LATE
            refused = late_chunking.refusal(slot.description, request.outputs) if late else None
            if refused is not None:
                raise refused
            if not task_of(slot.task).stored_vectors:
                raise EngineError(Kind.INVALID_INPUT, f"model {served.name!r} is a {slot.task} model: chunking "
                                  "splits texts to embed", "chunking_unsupported", field="chunking")
            prompt = "" if request.prompt is None else prompt_text(
                slot.description, request.prompt, served.settings.model.input_type_prompts)
            size = self._piece_size(slot, chunking, prompt, request)
            texts = list(request.inputs)
            timeout_ms = request.timeout_ms or served.settings.batching.default_timeout_ms
            deadline = started + timeout_ms / 1e3
            async with self._splitting(deadline):
                pieces = await asyncio.to_thread(self._split, texts, slot, size, chunking.overlap)
            inputs = [text[p.start:p.end] for text, found in zip(texts, pieces, strict=True) for p in found]
            # Pinned to this load: its tokenizer counted the pieces. Each piece is encoded as its document asked.
            options = request.text_options.taking(d for d, found in enumerate(pieces) for _ in found)
            pinned = dataclasses.replace(request, model=served.name, version=slot.version, chunking=None,
                                         text_options=options)
            await self._check_token_vectors(slot, pinned, inputs, prompt, 2 if chunking.mode == "pieces" else 1,
                                            deadline)
            wave, in_flight = wave_plan(served.settings.batching)
            if late:
                return await self._late(pinned, texts, pieces, slot, prompt, (wave, in_flight), deadline,
                                        disconnected)
            results = await self._waves(pinned, inputs, wave, in_flight, deadline, disconnected)
            return self._merged(results, pieces, chunking, slot)

    async def _late(self, request: InferenceRequest, texts: list[str], pieces: list[list[Piece]], slot: ModelSlot,
                    prompt: str, waves: tuple[int, int], deadline: float,
                    disconnected: Callable[[], Awaitable[Any]] | None) -> TaskResult:
        """Late chunking (core/late_chunking.py): windows of whole pieces run as inputs asking for their token
        states, each piece pooled from its window's; answered as mode ``pieces`` is."""
        window = slot.description.max_seq_length or slot.loaded.max_seq_length or 0
        async with self._splitting(deadline):
            late = await asyncio.to_thread(late_chunking.plan, texts, pieces, slot.loaded.tokenizer, prompt, window)
        inputs = [text for _, text in late.inputs]
        asking = dataclasses.replace(request, outputs=(TOKEN_STATES.name,),
                                     text_options=request.text_options.taking(d for d, _ in late.inputs))
        wave = late_chunking.wave_size(window, self.limits.max_multivector_tokens, waves[0])
        results = await self._waves(asking, inputs, wave, waves[1], deadline, disconnected)
        return await asyncio.to_thread(late_chunking.merged, late, results, slot.description, DocumentPieces)

    async def _rerank(self, request: InferenceRequest, batching: Any, slot: ModelSlot, started: float,
                      disconnected: Callable[[], Awaitable[Any]] | None) -> TaskResult:
        """Long-document rerank (core/long_rerank.py): a document too long beside its query scored piece by piece,
        each (query, piece) an ordinary pair, its pieces' scores combined (max or mean)."""
        chunking = request.chunking
        assert chunking is not None
        pairs = list(request.inputs)
        deadline = started + (request.timeout_ms or batching.default_timeout_ms) / 1e3
        async with self._splitting(deadline):
            planned = await asyncio.to_thread(long_rerank.plan, pairs, slot, chunking,
                                              self.limits.max_document_pieces, self.limits.max_request_pieces)
        inputs = [(query, document[p.start:p.end] if was_split else document)
                  for (query, document), found, was_split in zip(pairs, planned.pieces, planned.split, strict=True)
                  for p in found]
        options = request.text_options.taking(i for i, found in enumerate(planned.pieces) for _ in found)
        pinned = dataclasses.replace(request, model=slot.description.name, version=slot.version, chunking=None,
                                     text_options=options)
        wave, in_flight = wave_plan(batching)
        results = await self._waves(pinned, inputs, wave, in_flight, deadline, disconnected)
        return long_rerank.scored(planned, results, chunking.mode, slot.description)

    async def _check_token_vectors(self, slot: ModelSlot, request: InferenceRequest, inputs: list[str], prompt: str,
                                   answers: int, deadline: float) -> None:
        """A multi-vector answer over ``limits.max_multivector_tokens`` is refused before any piece runs, as a text's
        is (core/tasks/base.py TokenVectorTask): each wave passes the check alone, so the whole answer was refused
        only after every piece had run, and been charged. ``answers``: how many times the answer holds each piece's
        vectors (mode pieces: each piece's, and the document's, which joins them)."""
        handler = slot.handler
        if MULTIVECTOR.name not in request.outputs or not isinstance(handler, TokenVectorTask):
            return
        # As admission will tokenise them: the outputs asked and the prompt are the texts' options (core/admission.py).
        options = request.text_options.chosen(request.outputs, prompt)
        texts = [prompt + t for t in inputs] if prompt else inputs
        async with self._splitting(deadline):
            encoded = await asyncio.to_thread(handler.encode_texts, texts, options)
        count = answers * sum(map(handler.token_vectors, encoded))
        if count > handler.max_token_vectors:
            raise EngineError(Kind.TOO_LONG, token_vectors_refusal(count, handler.max_token_vectors),
                              "too_many_token_vectors")

    @contextlib.asynccontextmanager
    async def _splitting(self, deadline: float) -> AsyncIterator[None]:
        """One of the ``limits.preprocess_concurrency`` places that split documents, waited for no longer than the
        request's deadline (504 past it): a request behind another's long split was held past its timeout_ms."""
        try:
            await asyncio.wait_for(self._threads.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise deadline_passed() from None
        try:
            yield
        finally:
            self._threads.release()

    def _piece_size(self, slot: ModelSlot, chunking: Chunking, prompt: str, request: InferenceRequest) -> int:
        tokenizer = slot.loaded.tokenizer
        window = slot.description.max_seq_length or slot.loaded.max_seq_length
        # The handler's own bound for these texts where it has one (a ColBERT role's length), the tightest of them.
        own = [w for o in set(request.text_options.per_text(len(request.inputs)))
               if (w := slot.handler.text_window(o.chosen(request.outputs, prompt))) is not None]
        window = min(own + ([window] if window else []), default=window)
        if tokenizer is None or window is None:
            raise EngineError(Kind.INVALID_INPUT, f"model {slot.description.name!r} cannot split documents: it has "
                              "no tokenizer or no window to count pieces by", "chunking_unsupported",
                              field="chunking")
        prompt_tokens = len(backend(tokenizer).encode(prompt, add_special_tokens=False).ids) if prompt else 0
        room = window - special_tokens(tokenizer) - prompt_tokens
        if room <= 0:
            raise EngineError(Kind.INVALID_INPUT, f"the prompt of model {slot.description.name!r} leaves no room for "
                              f"a piece in its window of {window} tokens", "chunking_unsupported", field="chunking")
        size = chunking.max_tokens or room
        if size > room:
            raise EngineError(Kind.INVALID_INPUT, f"pieces of {size} tokens do not fit model "
                              f"{slot.description.name!r}: its window of {window} tokens leaves {room} beside its "
                              f"special tokens and prompt", "chunk_too_large", field="chunking.max_tokens")
        if chunking.overlap >= size:
            raise EngineError(Kind.INVALID_INPUT, f"overlap ({chunking.overlap} tokens) must be less than the "
                              f"piece size ({size} tokens)", "overlap_too_large", field="chunking.overlap")
        return size

    def _split(self, texts: list[str], slot: ModelSlot, size: int, overlap: int) -> list[list[Piece]]:
        """Each text's pieces, refused as soon as one document or the request has too many."""
        out: list[list[Piece]] = []
        total = 0
        for i, text in enumerate(texts):
            found = split_within(text, slot.loaded.tokenizer, max_tokens=size, overlap=overlap,
                                 per_document=self.limits.max_document_pieces,
                                 left=self.limits.max_request_pieces - total, index=i)
            total += len(found)
            out.append(found)
        return out

    async def _waves(self, request: InferenceRequest, inputs: list[Any], wave: int, in_flight: int,
                     deadline: float, disconnected: Callable[[], Awaitable[Any]] | None) -> list[TaskResult]:
        """``inputs`` run as ``request``'s (pinned to the load that split them), ``wave`` at a time, ``in_flight``
        waves at once, as the request its tenant was admitted for (``serve_pieces``): every wave charges its
        pieces' tokens to the tenant's budget as any request does."""
        # One watcher of the client for every wave (each wave's would read the same connection).
        gone = None if disconnected is None else asyncio.ensure_future(disconnected())

        def watch() -> Awaitable[Any]:
            assert gone is not None
            return asyncio.shield(gone)

        turns = asyncio.Semaphore(in_flight)

        async def one(start: int) -> TaskResult:
            async with turns:
                left_ms = (deadline - time.monotonic()) * 1e3
                if left_ms <= 0:
                    raise deadline_passed()
                part = dataclasses.replace(request, inputs=tuple(inputs[start:start + wave]), timeout_ms=left_ms,
                                           calibrate=request.calibrate and start == 0,
                                           text_options=request.text_options.taking(range(start, start + wave)))
                return await self.admission.serve_inputs(part, None if gone is None else watch, admitted=True,
                                                         part_of_accepted=True)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(start)) for start in range(0, len(inputs), wave)]
        except BaseExceptionGroup as failed:
            # The first failure is the request's answer (the others were cancelled by it).
            raise failed.exceptions[0] from None
        finally:
            if gone is not None:
                gone.cancel()
        return [t.result() for t in tasks]

    def _merged(self, results: list[TaskResult], pieces: list[list[Piece]], chunking: Chunking,
                slot: ModelSlot) -> TaskResult:
        outputs = [o for r in results for o in r.outputs]
        tokens = [n for r in results for n in r.tokens]
        unit = bool(slot.description.normalize)
        answers: list[Any] = []
        counts: list[int] = []
        at = 0
        for found in pieces:
            mine = outputs[at:at + len(found)]
            pooled = merge(mine, [p.tokens for p in found], unit)
            answers.append(pooled if chunking.mode == "pooled" else DocumentPieces(found, mine, pooled))
            counts.append(sum(tokens[at:at + len(found)]))
            at += len(found)
        timings = merged_timings(results)
        return TaskResult(answers, counts, results[0].description, timings, results[0].calibration)
