"""``fleet:``: ``inferd fleet``'s nginx and workers."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from inferd.settings.base import Section


class FleetSettings(Section):
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
