"""How requests are served: limits, batching, threads, memory, the result cache and shadow traffic."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from inferd.settings.base import Section


class LimitSettings(Section):
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


class BatchingSettings(Section):
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
    # Background work (priority -100: batch jobs' lines) runs on a background worker whose pass stops while live
    # batches run (core/background.py); false: on the model's instances, between live batches, as one queue.
    background_pauses: bool = True
    # A torch background pass that meets live batches goes on, on half its threads, while they run on the other
    # half, instead of stopping for them (core/background.py).
    background_shares_cores: bool = False
    # Where a background batch runs whole (a compiled graph, or background_pauses off), a live request waits for the
    # one in flight, so its padded tokens are bounded, tighter while live requests came within background_quiet_s
    # (not on a graph of several instances, whose live batches run on their own streams beside it: core/scheduler.py).
    background_max_batch_tokens: int = Field(2048, gt=0)
    background_live_batch_tokens: int = Field(512, gt=0)
    background_quiet_s: float = Field(1.0, ge=0)
    # The OS priority (nice, 0-19) a background pass runs at where it cannot stop for live work (a compiled graph);
    # 0: the live threads' own. Raised once, never lowered back without the privilege to (core/background.py).
    background_nice: int = Field(19, ge=0, le=19)

    # On the section, not Settings, so the error is reported at "batching" with the sources that set it.
    @model_validator(mode="after")
    def _consistent(self) -> BatchingSettings:
        if self.max_queue < self.max_batch_size:
            raise ValueError("batching.max_queue must be at least batching.max_batch_size")
        return self


class RuntimeSettings(Section):
    # 0 = let torch decide (one per core).
    torch_threads: int = Field(0, ge=0)
    seed: int = 0


class MemorySettings(Section):
    check_every_n: int = Field(1000, gt=0)
    fragmentation_threshold: float = Field(0.3, gt=0.0, lt=1.0)
    expandable_segments: bool = True
    per_process_fraction: float | None = Field(None, gt=0.0, le=1.0)
    # Host memory under glibc (bench/RESULTS.md, "Soak"). Requests (counted once per batch they ran in) between
    # trims of the heap's free pages on the worker; 0 = never, and RSS climbs for as long as the server runs.
    malloc_trim_every_n: int = Field(20, ge=0)
    # The most of the worker's time trims may take: after a trim of d seconds the next waits d / share (0 = no
    # bound, the default). Binds only under heavy load: 0.01 saved 2-9 % of a server's CPU at 32 clients, and on
    # torch RSS stood at 859 MB after 60 s of it against 532 (bench/RESULTS.md, "The heap's trims under load").
    malloc_trim_max_share: float = Field(0.0, ge=0.0, le=1.0)
    # Bytes from which blocks get their own mapping, set once at start; 0 = glibc's dynamic threshold. A fixed
    # one keeps RSS flatter than the trim alone but costs ~15 % more CPU per batch (page faults).
    malloc_mmap_threshold: int = Field(0, ge=0, le=33_554_432)
    # After each model load, collect once and freeze the heap out of the collector's walks (core/memory.py
    # settle_heap): ~0.16 s at each load instead of a ~0.22 s pause every few seconds while serving. On in the
    # prod overlay; off by default, where loads are many and serving short (development, the tests' processes).
    freeze_heap: bool = False


class CacheSettings(Section):
    # 0 = no cache. Each entry holds one vector (384 floats for MiniLM: 1.5 KiB) and a 16-byte key.
    max_entries: int = Field(0, ge=0)
    # The most bytes the entries' arrays may hold (1 GiB; 0 = no byte bound): a multi-vector or token-state output is
    # one vector per token, up to megabytes a text, so max_entries alone does not bound what a client can make it hold.
    max_bytes: int = Field(1 << 30, ge=0)


class ShadowSettings(Section):
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
