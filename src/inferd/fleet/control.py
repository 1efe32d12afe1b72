"""Talking to a running fleet: supervisord over XML-RPC on its unix socket, the workers over HTTP.

``RunDir`` finds and reads a fleet's run folder; ``status`` gathers what ``inferd fleet status`` prints and
what the running fleet writes to /health/fleet.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import xmlrpc.client
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from inferd.fleet.layout import Layout, WorkerSlot

_SPAWNED = re.compile(r"spawned: '([^']+)' with pid")
_QUEUE = re.compile(r"^inferd_queue_depth(?:\{[^}]*\})?\s+(\S+)", re.M)


class FleetNotFound(Exception):
    """No running fleet where the command looked; the message says where it looked."""


def pointer_path(port: int) -> Path:
    """Where a running fleet on nginx port ``port`` leaves its run folder's path for the other commands."""
    return Path(tempfile.gettempdir()) / f"inferd-fleet-{port}.json"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_run_dir(explicit: Path | None, port: int) -> Path:
    """--run-dir, else $INFERD_FLEET_RUN_DIR, else the pointer the fleet on ``port`` left in the temp folder."""
    if explicit is None and os.environ.get("INFERD_FLEET_RUN_DIR"):
        explicit = Path(os.environ["INFERD_FLEET_RUN_DIR"])
    if explicit is not None:
        if not (explicit / "layout.json").is_file():
            raise FleetNotFound(f"{explicit} is not a fleet's run folder (no layout.json)")
        return explicit
    pointer = pointer_path(port)
    try:
        data = json.loads(pointer.read_text())
    except (OSError, ValueError):
        raise FleetNotFound(f"no fleet is running on port {port} (no {pointer}); give --run-dir or --port") from None
    if not pid_alive(int(data.get("pid", 0))):
        raise FleetNotFound(f"the fleet on port {port} is gone (its pointer {pointer} is stale); give --run-dir")
    return Path(data["run_dir"])


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / "layout.json").read_text())

    @property
    def layout(self) -> Layout:
        return Layout.from_dict(self.meta)

    @property
    def admin_key(self) -> str:
        return (self.path / "admin.key").read_text().strip()

    @property
    def socket(self) -> Path:
        return self.path / "supervisor.sock"

    def metrics_key(self) -> str | None:
        import yaml

        with contextlib.suppress(OSError, ValueError, AttributeError):
            data = yaml.safe_load((self.path / "config" / "base.yaml").read_text())
            return data["server"].get("metrics_key")
        return None


class Supervisor:
    """supervisord's XML-RPC interface over the fleet's unix socket (what supervisorctl uses)."""

    def __init__(self, socket: Path) -> None:
        from supervisor.xmlrpc import SupervisorTransport

        transport = SupervisorTransport(None, None, f"unix://{socket}")
        # The host is ignored: the transport connects to the socket.
        self.rpc: Any = xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)

    def processes(self) -> dict[str, dict[str, Any]]:
        return {p["name"]: p for p in self.rpc.supervisor.getAllProcessInfo()}

    def spawns(self) -> Counter[str]:
        """How often supervisord started each program, from its log (never rotated: see supervisord.conf)."""
        return Counter(_SPAWNED.findall(self.rpc.supervisor.readLog(0, 0)))

    def restarts(self) -> dict[str, int]:
        return {name: max(0, n - 1) for name, n in self.spawns().items()}


def probe(client: httpx.Client, w: WorkerSlot) -> dict[str, Any]:
    """A worker's readiness as its load balancer sees it: GET /health/ready."""
    try:
        r = client.get(f"{w.url}/health/ready")
        body = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"ready": False, "status": f"unreachable ({type(exc).__name__})", "version": None}
    return {"ready": r.status_code == 200, "status": body.get("status", str(r.status_code)),
            "version": body.get("version")}


def models(client: httpx.Client, w: WorkerSlot, admin_key: str, model: str | None = None) -> dict[str, Any]:
    """GET /admin/models on the worker's admin port (``model``: with that model's lifecycle at the top level);
    raises httpx errors and non-2xx as they come."""
    r = client.get(f"{w.admin_url}/admin/models", params={"model": model} if model else None,
                   headers={"Authorization": f"Bearer {admin_key}"})
    r.raise_for_status()
    return r.json()


def queue_depth(client: httpx.Client, w: WorkerSlot, metrics_key: str | None) -> float | None:
    headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
    try:
        r = client.get(f"{w.url}/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    found = _QUEUE.findall(r.text) if r.status_code == 200 else []
    # One series per model: the worker's queue is their sum (as the HPA's query sums them).
    return sum(float(v) for v in found) if found else None


def _versions(data: dict[str, Any]) -> str:
    """The versions served; with several models, each named: ``embedder 2, reranker 1 (canary 0.1) 2``."""
    models = data.get("models") or [{"name": None, **data}]
    out = []
    for model in models:
        parts = []
        for slot in model.get("slots") or []:
            tag = slot["version"]
            if slot["role"] == "canary":
                tag += f" (canary {model.get('canary_weight', 0):g})"
            parts.append(tag)
        tags = ", ".join(parts) or "-"
        out.append(f"{model['name']} {tags}" if len(models) > 1 else tags)
    return "; ".join(out) or "-"


def status(run: RunDir, detailed: bool = True, timeout: float = 3.0) -> dict[str, Any]:
    """Every worker: supervisord's state, pid and restarts; readiness; and, detailed, versions and queue depth."""
    layout, meta = run.layout, run.meta
    try:
        sup = Supervisor(run.socket)
        procs, restarts = sup.processes(), sup.restarts()
        reachable = True
    except (OSError, xmlrpc.client.Error) as exc:
        procs, restarts, reachable = {}, {}, False
        supervisor_error = f"{type(exc).__name__}: {exc}"
    workers = []
    with httpx.Client(timeout=timeout) as client:
        for w in layout.workers:
            proc = procs.get(w.name, {})
            row: dict[str, Any] = {"name": w.name, "url": w.url, "gpu": w.gpu, "state": proc.get("statename", "?"),
                                   "pid": proc.get("pid") or None, "restarts": restarts.get(w.name, 0),
                                   **probe(client, w)}
            if detailed:
                try:
                    data = models(client, w, run.admin_key)
                    row["versions"] = _versions(data)
                    row["slots"] = data.get("slots", [])
                except (httpx.HTTPError, ValueError):
                    row["versions"], row["slots"] = "?", []
                row["queue_depth"] = queue_depth(client, w, run.metrics_key())
            workers.append(row)
    ready = sum(1 for w in workers if w["ready"])
    nginx = procs.get("nginx", {})
    out = {"status": "ok" if ready == len(workers) else ("degraded" if ready else "down"),
           "ready": ready, "workers_total": len(workers), "workers": workers,
           "nginx": {"state": nginx.get("statename", "?"), "pid": nginx.get("pid") or None,
                     "url": f"http://{meta['listen']['host']}:{meta['listen']['port']}",
                     "stub_status": f"http://127.0.0.1:{meta['status_port']}/nginx_status"},
           "run_dir": str(run.path), "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if not reachable:
        out["supervisor_error"] = supervisor_error
    return out


def format_status(data: dict[str, Any]) -> str:
    rows = [("worker", "state", "pid", "ready", "version(s)", "queue", "restarts", "gpu")]
    for w in data["workers"]:
        q = w.get("queue_depth")
        rows.append((w["name"], w["state"], str(w["pid"] or "-"), "yes" if w["ready"] else f"no ({w['status']})",
                     w.get("versions", w.get("version") or "-"), "-" if q is None else f"{q:g}",
                     str(w["restarts"]), w["gpu"] or "cpu"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    nginx = data["nginx"]
    head = (f"fleet {data['status']}: {data['ready']}/{data['workers_total']} workers ready; nginx {nginx['state']} "
            f"at {nginx['url']} (stub_status {nginx['stub_status']}); run folder {data['run_dir']}")
    tail = [f"supervisord unreachable: {data['supervisor_error']}"] if "supervisor_error" in data else []
    return "\n".join([head, "", *lines, *tail])
