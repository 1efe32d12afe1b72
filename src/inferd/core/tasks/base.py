"""The task contract: the base class every handler (embedding, rerank, classification, a user's own) derives from.

A handler is loaded once per model slot. ``preprocess`` runs on the CPU (tokenisation) and turns the
request's inputs (texts, or (query, document) pairs, as ``inputs`` says) into one ``Encoded`` item per
input; ``infer`` is the only code that touches the device; ``postprocess`` turns the batch output into one
opaque result per item, which only the task's routes know how to shape. The engine, queue, scheduler and
slots never look inside an item or a result: they move token costs and hand results back in order.

Every member anything outside a handler reads is declared on ``Handler`` with its default, so nothing probes a
handler with ``getattr``/``hasattr`` (tests/unit/test_handler_contract.py holds every module to it).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from inferd.core.backends.base import Runner, options_for
from inferd.core.backends.factory import open_backend
from inferd.core.description import Loaded, ModelDescription, TaskFacts
from inferd.core.errors import ModelLoadError
from inferd.core.families import family_of
from inferd.core.outputs import token_vectors_refusal
from inferd.core.preprocess import Encoded, InputError
from inferd.core.spec import ModelSpec
from inferd.core.staging import StagedBatch, to_device
from inferd.core.tasks.kinds import TASKS, task_of
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions

log = logging.getLogger(__name__)

# Any one of these lets a fast tokenizer be built; a folder with none has no tokenizer at all.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
# The tasks served by the built-in handlers (each one's task object, core/tasks/kinds.py); a plug-in
# (``module:Class``) names its own.
BUILTIN_TASKS = tuple(TASKS)


class Handler(ABC):
    """The contract. A subclass implements ``load``, ``preprocess``, ``infer`` and ``postprocess``; every other
    member has a default, which a subclass overrides by assigning it on the class.

    ``task`` and ``inputs`` left as they are serve embeddings of texts. ``load`` returns what it found, a ``Loaded``
    (core/description.py: the task's facts about the model, such as an embedding's size or a classifier's labels, and
    where its forward pass runs), which ``open`` checks and holds as ``loaded`` and the slot takes once;
    ``incompatibility(serving, allow_change)`` says why this model may not replace or sit beside the serving one (its
    description), or None. The defaults hold an embedding handler to the dimension rule.
    """

    task: str = "embedding"
    inputs: str = "texts"  # or "pairs": (query, document) tuples
    _loaded: Loaded | None = None

    @abstractmethod
    def load(self, spec: ModelSpec, device: torch.device) -> Loaded: ...

    @abstractmethod
    def preprocess(self, inputs: list[Any]) -> list[Encoded]: ...

    def preprocess_with(self, inputs: list[Any], options: InputOptions) -> list[Encoded]:
        """``preprocess`` of a request's inputs with the request's options of each (core/text_options.py: the side
        cut, truncate, max_tokens, role, the outputs asked), as admission tokenises them. A prompt is already in
        its text, so by default the inputs alone go to ``preprocess``; the built-in tasks read the options too."""
        return self.preprocess(inputs)

    @abstractmethod
    def infer(self, batch: list[Encoded]) -> Any: ...

    @abstractmethod
    def postprocess(self, outputs: Any) -> list[Any]: ...

    def open(self, spec: ModelSpec, device: torch.device) -> Loaded:
        """``load``, and what it returned checked and held as ``loaded``: a plug-in written to the contract before
        ``load`` returned a ``Loaded`` (it returned None and set attributes) is refused, naming what it returned."""
        found = self.load(spec, device)
        wrong = (f"returned {type(found).__name__}" if not isinstance(found, Loaded) else
                 f"returned facts of type {type(found.facts).__name__}" if not isinstance(found.facts, TaskFacts) else
                 None)
        if wrong is not None:
            self.close()
            raise ModelLoadError(f"{type(self).__name__}.load() {wrong}; it returns a Loaded, its facts a TaskFacts "
                                 "(inferd.core.description: docs/handler.md)")
        self._loaded = found
        return found

    @property
    def loaded(self) -> Loaded:
        """What ``open`` found; a handler not yet opened has found nothing."""
        if self._loaded is None:
            raise ModelLoadError(f"{type(self).__name__} is not loaded")
        return self._loaded

    def close(self) -> None:  # noqa: B027 (a default, not a stage left out)
        """Drop the weights (a handler that holds none has nothing to do)."""

    def stage(self, batch: list[Encoded], copy: Any, compute: Any) -> list[Encoded]:
        """On a GPU instance, the next batch's inputs put on the device on the ``copy`` stream while the current
        batch runs on ``compute`` (core/staging.py); ``infer`` then gets what this returns. By default nothing
        is staged: the batch as it is."""
        return batch

    def pause_points(self) -> list[Any]:
        """The modules a background batch's pass may stop before while live batches run (core/background.py); by
        default none: a plug-in's pass runs whole."""
        return []

    def warmup(self) -> None:  # noqa: B027
        """Run a batch or two before serving (after ``load``, when ``model.warmup`` is on)."""

    def document_room(self, query: str) -> int | None:
        """The tokens a document may hold beside ``query`` in one input (a reranker's pair: what the model's limit
        leaves after the query, its template and special tokens), by which core/long_rerank.py splits a longer
        document; None (the default): this handler's documents are not split."""
        return None

    def text_window(self, options: TextOptions) -> int | None:
        """The tokens one text may hold with its special tokens under ``options``, by which core/pieces.py sizes a
        document's pieces; None (the default): the model's window (``max_seq_length``). A handler whose texts have
        other bounds (a late-interaction model's role lengths, its marker token) says so, or a piece would be cut."""
        return None

    def incompatibility(self, serving: ModelDescription, allow_change: bool) -> str | None:
        """Why this model may not replace the serving one; by default an embedding handler is held to the
        dimension rule (its vectors are stored: ``Task.stored_vectors``) and any other task's model is accepted."""
        if not task_of(self.task).stored_vectors:
            return None
        return dimension_refusal(self.loaded.facts.dimension, serving, allow_change)


def dimension_refusal(dimension: int | None, serving: ModelDescription, allow_change: bool) -> str | None:
    """Vectors of another size cannot be compared with those clients already stored."""
    old = serving.dimension
    if old is None or old == dimension or allow_change:
        return None
    return (f"embedding dimension is {dimension}, the serving model's is {old}; "
            "set model.allow_dimension_change: true to allow it")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def check_weights(path: Path, allow_pickle: bool) -> bool:
    """Return whether safetensors weights are there; refuse pickle weights unless allowed."""
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    if any(path.glob("*.safetensors")):
        return True
    if any(path.glob("pytorch_model*.bin")):
        if allow_pickle:
            return False
        raise ModelLoadError(f"{path} holds only pickle weights (pytorch_model.bin); "
                             "set model.allow_pickle: true to load them")
    raise ModelLoadError(f"{path} holds no weights (model.safetensors)")


def check_tokenizer_files(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer that maps every word to [UNK], silently.
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.json or a vocabulary file)")


def load_tokenizer(path: Path) -> tuple[Any, Any]:
    """The folder's config and fast tokenizer (a slow one is refused: the Rust tokenizer does the work), for a
    model of a supported family (core/families.py)."""
    from transformers import AutoConfig, AutoTokenizer

    family_of(path)
    check_tokenizer_files(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {path}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{path}: a fast (tokenizer.json) tokenizer is required")
    return config, tokenizer


def length_limit(config: Any, tokenizer: Any, wanted: int | None) -> int:
    """Tokens per input: the setting or the model's own limit, never more than its position table."""
    limit = min(int(getattr(config, "max_position_embeddings", 512)),
                int(tokenizer.model_max_length) if tokenizer.model_max_length < 1e6 else 512)
    return min(wanted or limit, limit)


def collate(batch: list[Encoded], pad_id: int, segments: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The padded batch every runner takes: ``input_ids``, ``attention_mask`` and (``segments``: for a model
    that reads them) ``token_type_ids``. Padding is masked, so a row never sees another."""
    longest = max(e.tokens for e in batch)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), longest), dtype=np.int64)
    types = np.zeros((len(batch), longest), dtype=np.int64) if segments else None
    for row, enc in enumerate(batch):
        ids[row, : enc.tokens] = enc.ids
        mask[row, : enc.tokens] = 1
        if types is not None and enc.type_ids is not None:
            types[row, : enc.tokens] = enc.type_ids
    return torch.from_numpy(ids), torch.from_numpy(mask), None if types is None else torch.from_numpy(types)


class ModelTask(Handler):
    """What the built-in tasks share: a tokenizer's padding id, a runner for the task's head (``hidden`` or
    ``logits``, see backends/base.py) on the configured backend, one collate, and closing the runner.

    A subclass sets ``task``, ``head``, ``pad_id`` and its encoder before ``open_runner``: exporting a graph
    and its accuracy gate run the task's own tokenising and outputs (``forward``).
    """

    head: str
    max_seq_length: int  # set by load, before open_runner
    pad_id: int = 0
    segments: bool = False
    # A classifier's labels each through a sigmoid, not one softmax (the accuracy gate judges them so).
    multi_label: bool = False
    # An embedding model's outputs (core/outputs.py OUTPUTS): a dense vector unless the model gives others.
    outputs: tuple[str, ...] = ("dense",)
    # An embedding's vector size, its pooling and whether its vectors are unit length (None: not said).
    dimension: int | None = None
    pooling: str | None = None
    normalize: bool | None = None
    # The fast tokenizer the load shows (``Loaded.tokenizer``); None: none to show.
    tokenizer: Tokenizer | None = None
    runner: Runner
    device: torch.device

    @abstractmethod
    def preprocess(self, inputs: list[Any], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        """The inputs tokenised, each as its options (``options``, in order) say."""

    def preprocess_with(self, inputs: list[Any], options: InputOptions) -> list[Encoded]:
        return self.preprocess(inputs, options)

    def open_runner(self, spec: ModelSpec, device: torch.device, safetensors: bool) -> Loaded:
        """The runner opened, and what the load found: the last step of every built-in ``load``."""
        if spec.backend not in ("torch", "auto") and spec.device == "auto":
            device = torch.device("cpu")  # ONNX Runtime and OpenVINO run on the CPU here, GPU or not
        self.runner = runner = open_backend(spec.path, options_for(spec, self.task, self.head), device, self,
                                            safetensors)
        self.device = runner.device
        return Loaded(facts=self.facts(), max_seq_length=self.max_seq_length, device=str(runner.device),
                      dtype=runner.dtype, backend=runner.backend, quantize=runner.quantize,
                      backend_info=None if runner.info is None else dict(runner.info),
                      capabilities=runner.capabilities, tokenizer=self.tokenizer)

    def facts(self) -> TaskFacts:
        """The task's facts about the loaded model (``Loaded.facts``); by default an embedding's ``dimension``,
        ``pooling`` and ``normalize``."""
        return TaskFacts(**task_of(self.task).facts(self.dimension), pooling=self.pooling, normalize=self.normalize)

    def collate(self, batch: list[Encoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if isinstance(batch, StagedBatch):  # padded and copied to the device while the batch before it ran
            ids, mask, types = batch.take()
            assert ids is not None and mask is not None
            return ids, mask, types
        return collate(batch, self.pad_id, self.segments)

    def stage(self, batch: list[Encoded], copy: Any, compute: Any) -> list[Encoded]:
        """The padded batch copied to the GPU on ``copy``, where the runner ``stages`` (torch's on a CUDA device
        only: ONNX Runtime and OpenVINO take host memory)."""
        if not self.runner.capabilities.stages:
            return batch
        tensors, event = to_device(self.collate(batch), self.device, copy)
        return StagedBatch(batch, tensors, event, compute)

    def pause_points(self) -> list[Any]:
        return self.runner.pause_points() if self.runner.capabilities.pauses else []

    def head_module(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The task's own module over the loaded model, for a head the task defines (backends/base.py
        TASK_HEADS); None: this task defines none."""
        return None

    def forward(self, runner: Runner, batch: list[Encoded]) -> np.ndarray:
        raise NotImplementedError

    def forward_outputs(self, runner: Runner, batch: list[Encoded]) -> dict[str, list[Any]]:
        """Each of ``outputs``' values per input, for the accuracy gate: a dense vector, a sparse vector as (ids,
        weights), token vectors ``[tokens, dim]``."""
        return {"dense": list(self.forward(runner, batch))}

    def infer(self, batch: list[Encoded]) -> np.ndarray:
        return self.forward(self.runner, batch)

    def close(self) -> None:
        if "runner" in vars(self):  # a load that failed before open_runner has none
            self.runner.close()


class TokenVectorTask(ModelTask):
    """A task whose texts may give token vectors (ColBERT's, bge-m3's multi-vector output): a text's count is its
    kept tokens, known once it is tokenised, so a request whose answer would hold more than
    ``limits.max_multivector_tokens`` (``spec.max_token_vectors``) is refused here, before it queues: no pass runs
    and nothing is charged for an answer that could never be sent.

    A subclass tokenises in ``encode_texts`` and counts an item's vectors in ``token_vectors``; a late-interaction
    reranker over it calls ``encode_texts``, as its answer is a score per pair, not the vectors.
    """

    max_token_vectors: int

    def encode_texts(self, texts: list[Any], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        raise NotImplementedError

    def token_vectors(self, item: Encoded) -> int:
        """The token vectors the answer will hold for ``item`` (0 when its text did not ask for them)."""
        raise NotImplementedError

    def preprocess(self, texts: list[Any], options: InputOptions = PLAIN_INPUTS) -> list[Encoded]:
        encoded = self.encode_texts(texts, options)
        count = sum(map(self.token_vectors, encoded))
        if count > self.max_token_vectors:
            raise InputError(None, token_vectors_refusal(count, self.max_token_vectors), "too_many_token_vectors")
        return encoded
