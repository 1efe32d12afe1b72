"""Who runs where: each worker's ports, GPU, memory fraction and torch threads, from Settings alone.

Pure: the visible GPUs, the core count and the port picker are arguments, so the layout of four workers on
two GPUs is tested on a machine with none.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from inferd.core.budgets import describe
from inferd.settings import Settings

# Workers on a CPU when fleet.workers is not set: two shows the fleet working without oversubscribing.
CPU_WORKERS = 2


@dataclass(frozen=True)
class WorkerSlot:
    index: int
    name: str
    port: int
    admin_port: int
    gpu: str | None  # the CUDA device id (or UUID) the worker sees as its only device; None on a CPU
    torch_threads: int
    memory_fraction: float | None  # memory.per_process_fraction, for workers sharing a GPU
    # Each model's instances x threads inside the worker (core/budgets.py: its torch_threads split between them).
    instances: str = ""
    # Its gRPC port (server.grpc_port), when the fleet serves gRPC (fleet.grpc_port); None: no gRPC.
    grpc_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


@dataclass(frozen=True)
class Layout:
    workers: tuple[WorkerSlot, ...]
    gpus: tuple[str, ...]
    cores: int

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": list(self.gpus), "cores": self.cores, "workers": [asdict(w) for w in self.workers]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        return cls(tuple(WorkerSlot(**w) for w in data["workers"]), tuple(data["gpus"]), int(data["cores"]))

    def table(self) -> str:
        rows = [("worker", "port", "admin port", "gpu", "torch threads", "memory fraction", "instances x threads")]
        for w in self.workers:
            rows.append((w.name, str(w.port), str(w.admin_port), w.gpu if w.gpu is not None else "cpu",
                         str(w.torch_threads), "-" if w.memory_fraction is None else f"{w.memory_fraction:g}",
                         w.instances or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
        return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

    def summary(self) -> str:
        n = len(self.workers)
        workers = f"{n} worker{'s' if n != 1 else ''}"
        if not self.gpus:
            return f"{workers} on the CPU ({self.cores} cores)"
        used = sorted({w.gpu for w in self.workers if w.gpu is not None}, key=self.gpus.index)
        return f"{workers} on {len(used)} GPU{'s' if len(used) != 1 else ''} ({', '.join(used)})"


def visible_gpus(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The CUDA devices this process may use: CUDA_VISIBLE_DEVICES when set, else every device NVML sees.

    NVML, not torch: initialising CUDA in the fleet's parent would hold a context on every GPU for nothing.
    """
    environ = dict(os.environ) if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids = tuple(p.strip() for p in environ["CUDA_VISIBLE_DEVICES"].split(",") if p.strip())
        # CUDA stops at the first invalid id ("-1" is the usual way to hide every device).
        valid = []
        for gpu in ids:
            if gpu.startswith("-"):
                break
            valid.append(gpu)
        return tuple(valid)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return tuple(str(i) for i in range(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: a CPU machine
        return ()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fraction(sharing: int, margin: float, configured: float | None) -> float | None:
    """memory.per_process_fraction of one of ``sharing`` workers on a GPU; an operator's smaller value stands."""
    if sharing <= 1:
        return configured
    # Rounded down, so the fractions of one GPU never add up past (1 - margin).
    share = math.floor((1.0 - margin) / sharing * 10_000) / 10_000
    return share if configured is None else min(share, configured)


def plan(settings: Settings, gpus_visible: Sequence[str], cores: int,
         port: Callable[[], int] = free_port) -> Layout:
    """The fleet's layout: worker i on GPU gpus[i * G // N] (contiguous blocks), threads split on the CPU."""
    fleet = settings.fleet
    gpus = tuple(fleet.gpus) if fleet.gpus is not None else tuple(gpus_visible)
    n = fleet.workers or (len(gpus) * fleet.workers_per_gpu if gpus else CPU_WORKERS)
    assigned = [gpus[i * len(gpus) // n] if gpus else None for i in range(n)]
    sharing = {g: assigned.count(g) for g in set(assigned)}
    # Each worker gets its share of the cores, so N workers do not oversubscribe the machine (tokenising runs
    # on the CPU on a GPU host too); an operator's explicit runtime.torch_threads stands.
    threads = settings.runtime.torch_threads or max(1, cores // n)
    split = describe(settings, threads)
    taken: set[int] = set()

    def pick() -> int:
        while (p := port()) in taken:
            pass
        taken.add(p)
        return p

    workers = []
    for i, gpu in enumerate(assigned):
        if fleet.worker_base_port is not None:
            main, admin = fleet.worker_base_port + 2 * i, fleet.worker_base_port + 2 * i + 1
        else:
            main, admin = pick(), pick()
        fraction = _fraction(sharing[gpu], fleet.memory_margin, settings.memory.per_process_fraction) \
            if gpu is not None else None
        grpc = None
        if fleet.grpc_port is not None:  # after the HTTP and admin ports: base + 2N + i
            grpc = fleet.worker_base_port + 2 * n + i if fleet.worker_base_port is not None else pick()
        workers.append(WorkerSlot(i, f"worker-{i}", main, admin, gpu, threads, fraction, split, grpc))
    return Layout(tuple(workers), gpus, cores)


def dumps(layout: Layout, **extra: Any) -> str:
    return json.dumps({**layout.to_dict(), **extra}, indent=2)
