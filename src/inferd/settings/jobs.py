"""``jobs:``: batch jobs (OpenAI's Files and Batches API)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from inferd.settings.base import Section


class JobsSettings(Section):
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
    # Lines of this process's chunks given to the engine at once: each line's route work runs on the event loop,
    # so a whole chunk given at once is a burst every live request then waits behind; a few batches' worth keeps
    # the workers fed.
    lines_in_flight: int = Field(128, ge=1, le=100_000)
    # Seconds a claimed chunk is its worker's; past it (a worker killed) any worker takes it again.
    lease_s: float = Field(60.0, gt=0)
    # Seconds a worker with nothing to do waits before it looks again.
    poll_s: float = Field(0.5, gt=0)
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0)
    max_line_bytes: int = Field(1_048_576, gt=0)
    max_lines: int = Field(1_000_000, gt=0)
    # Files and finished jobs older than this are deleted (30 days).
    expiry_s: float = Field(30 * 86400.0, gt=0)
