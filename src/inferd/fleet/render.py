"""nginx.conf and supervisord.conf, rendered from the deploy/ templates for a fleet: every value they hold.

nginx spreads requests over the workers (least_conn) and serves the fleet's health; supervisord runs nginx and
the workers, each worker's per-worker values (port, admin port, threads, GPU, memory fraction) on its command line
and in its environment. fleet/run_dir.py writes them into the run folder.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.fleet.files import fill, read_template
from inferd.fleet.layout import Layout, WorkerSlot
from inferd.settings import Settings

# Seconds a worker may take after its drain to close (the server's own margin), and supervisord's on top.
WORKER_CLOSE_MARGIN_S = 5
STOP_MARGIN_S = 10


@dataclass(frozen=True)
class Fleet:
    """Everything a run folder is rendered from."""

    settings: Settings
    layout: Layout
    run_dir: Path
    status_port: int
    nginx: str
    admin_key: str
    user: str | None = None
    warning: str | None = None  # said at start and written into nginx.conf (nginx workers left as root)

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def socket(self) -> Path:
        return self.run_dir / "supervisor.sock"

    @property
    def drain_s(self) -> float:
        return self.settings.server.drain_timeout_s

    @property
    def proxy_read_timeout_s(self) -> int:
        configured = self.settings.fleet.proxy_read_timeout_s
        return int(configured if configured else self.settings.batching.default_timeout_ms / 1000 + 10)


def _sv(value: object) -> str:
    """A value for supervisord's file, where % starts an expansion."""
    return str(value).replace("%", "%%")


def worker_command(fleet: Fleet, w: WorkerSlot) -> list[str]:
    return [sys.executable, "-m", "inferd.cli", "serve", "--env", fleet.settings.env,
            "--config-dir", str(fleet.run_dir / "config"), "--host", "127.0.0.1", "--port", str(w.port),
            "--admin-port", str(w.admin_port), "--torch-threads", str(w.torch_threads)]


def worker_environment(w: WorkerSlot) -> dict[str, str]:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU: a CPU worker stays on the CPU on a GPU host too.
    env = {"CUDA_VISIBLE_DEVICES": w.gpu or "", "OMP_NUM_THREADS": str(w.torch_threads)}
    if w.memory_fraction is not None:
        env["INFERD__MEMORY__PER_PROCESS_FRACTION"] = f"{w.memory_fraction:g}"
    if w.grpc_port is not None:
        env["INFERD__SERVER__GRPC_PORT"] = str(w.grpc_port)
    return env


def render_nginx(fleet: Fleet, template: str | None = None) -> str:
    s, layout = fleet.settings, fleet.layout
    template = template if template is not None else read_template("nginx/nginx.conf")
    n = len(layout.workers)
    limit = s.server.limit_concurrency or 4096
    connections = max(1024, 2 * limit * n + 64)
    host = s.fleet.host
    values = {
        "user_directive": _user_directive(fleet),
        "worker_processes": "auto", "worker_connections": connections, "worker_rlimit_nofile": 2 * connections,
        "run_dir": fleet.run_dir, "log_dir": fleet.logs, "drain_timeout_s": int(fleet.drain_s),
        "max_body_bytes": s.limits.max_body_bytes, "body_buffer_bytes": min(s.limits.max_body_bytes, 1 << 20),
        "max_header_bytes": s.server.max_header_bytes, "header_timeout_s": _secs(s.server.header_timeout_s),
        "body_timeout_s": _secs(s.server.body_timeout_s), "keepalive_timeout_s": _secs(s.server.keepalive_timeout_s),
        "upstream_keepalive": 16 * n,
        "upstream_keepalive_timeout_s": max(1, _secs(s.server.keepalive_timeout_s) - 1),
        "listen": f"[{host}]:{s.fleet.port}" if ":" in host else f"{host}:{s.fleet.port}",
        "proxy_read_timeout_s": fleet.proxy_read_timeout_s, "next_upstream_timeout_s": 2 * fleet.proxy_read_timeout_s,
        "status_port": fleet.status_port,
        "targets_file": fleet.run_dir / "prometheus" / "targets.json",
    }
    each: dict[str, list[Mapping[str, Any]]] = {
        "worker": [{"worker_name": w.name, "worker_address": f"127.0.0.1:{w.port}", "worker_gpu": w.gpu or "cpu"}
                   for w in layout.workers],
        "grpc": _grpc_block(fleet)}
    return fill(template, values, each)


def _grpc_block(fleet: Fleet) -> list[Mapping[str, Any]]:
    """The gRPC server block's values (one block, or none when the fleet serves no gRPC: fleet.grpc_port)."""
    s = fleet.settings
    if s.fleet.grpc_port is None:
        return []
    servers = "\n".join(f"        server 127.0.0.1:{w.grpc_port} max_fails=0;  # {w.name}"
                        for w in fleet.layout.workers)
    host = s.fleet.host
    return [{"grpc_listen": f"[{host}]:{s.fleet.grpc_port}" if ":" in host else f"{host}:{s.fleet.grpc_port}",
             "grpc_servers": servers}]


def _user_directive(fleet: Fleet) -> str:
    if fleet.user is None:
        return "# user: not set (not run as root: nginx's workers keep the fleet's user)"
    return (f"# {fleet.warning}\n" if fleet.warning else "") + f"user {fleet.user};"


def _secs(value: float) -> int:
    """nginx takes whole seconds here; never round a limit down to 0."""
    return max(1, round(value))


def render_supervisord(fleet: Fleet, template: str | None = None) -> str:
    template = template if template is not None else read_template("supervisor/supervisord.conf")
    run, logs = _sv(fleet.run_dir), _sv(fleet.logs)
    nginx = [fleet.nginx, "-e", str(fleet.logs / "nginx-error.log"), "-p", f"{fleet.run_dir}/nginx/",
             "-c", str(fleet.run_dir / "nginx.conf")]
    values = {
        "run_dir": run, "log_dir": logs,
        "supervisord_user": "user = root" if os.geteuid() == 0 else "; user: not set (not run as root)",
        "nginx_command": _sv(shlex.join(nginx)),
        "nginx_stopwaitsecs": int(fleet.drain_s) + STOP_MARGIN_S,
        "worker_stopwaitsecs": int(fleet.drain_s) + WORKER_CLOSE_MARGIN_S + STOP_MARGIN_S,
        "worker_names": ",".join(w.name for w in fleet.layout.workers),
    }
    each = {"worker": [{
        "worker_name": w.name,
        "worker_command": _sv(shlex.join(worker_command(fleet, w))),
        "worker_environment": ",".join(f'{k}="{_sv(v)}"' for k, v in worker_environment(w).items()),
    } for w in fleet.layout.workers]}
    return fill(template, values, each)
