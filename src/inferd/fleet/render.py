"""The run folder: nginx.conf and supervisord.conf from the deploy/ templates, and the workers' configuration.

Layout of a run folder (every path nginx and supervisord use lies inside it):

    nginx.conf  supervisord.conf  layout.json  admin.key (0600)
    config/<base.yaml, <env>.yaml>   the workers' configuration (0600: it holds the keys)
    prometheus/targets.json          file_sd targets: one per worker, labels worker and gpu
    health/fleet.json                what nginx serves at /health/fleet (rewritten by the running fleet)
    nginx/                           nginx's pid and temp folders;  logs/  every log;  supervisor.sock

The workers read their configuration from config/: the fleet's effective settings, written out whole, so a
worker that supervisord restarts after ``inferd fleet reload`` starts on the model the fleet serves now
(the reload rewrites model.path and model.version there). Per-worker values (port, admin port, threads,
GPU, memory fraction) are on each worker's command line and environment in supervisord.conf.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from inferd.config import entry_tree
from inferd.fleet.layout import Layout, WorkerSlot
from inferd.settings import Settings, resolve_model_path

_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_EACH = re.compile(r"^#@each (\w+)\n(.*?)^#@end\n", re.S | re.M)
# Paths go into nginx and supervisord files unquoted: keep to characters neither reads specially.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9._/+-]+$")
NGINX_HINT = "nginx is not installed: install it with `apt-get install nginx` (or set fleet.nginx to its path)"
# Seconds a worker may take after its drain to close (the server's own margin), and supervisord's on top.
WORKER_CLOSE_MARGIN_S = 5
STOP_MARGIN_S = 10
SECRET_KEYS = ("admin_key", "api_keys", "metrics_key")
# sun_path holds 108 bytes on Linux (104 on BSDs), terminating NUL included.
MAX_SOCKET_PATH = 103


class RenderError(Exception):
    """The fleet cannot be rendered as configured; the message says why and what to change."""


def deploy_dir() -> Path:
    """deploy/ of this checkout ($INFERD_DEPLOY_DIR, ./deploy, or the repository's), like the configs folder."""
    env = os.environ.get("INFERD_DEPLOY_DIR")
    if env:
        return Path(env)
    cwd = Path.cwd() / "deploy"
    if (cwd / "nginx" / "nginx.conf").is_file():
        return cwd
    return Path(__file__).resolve().parents[3] / "deploy"


def read_template(name: str) -> str:
    path = deploy_dir() / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        raise RenderError(f"template {path} not found: run from the repository, or set INFERD_DEPLOY_DIR to "
                          "its deploy/ folder") from None


def fill(template: str, values: Mapping[str, Any], each: Mapping[str, list[Mapping[str, Any]]] | None = None) -> str:
    """Replace {{name}} placeholders; repeat "#@each X ... #@end" blocks once per item of each[X]."""
    each = each or {}

    def block(m: re.Match[str]) -> str:
        if m.group(1) not in each:
            raise RenderError(f"the template repeats a block per {m.group(1)!r}, which the renderer does not know")
        return "".join(fill(m.group(2), {**values, **item}) for item in each[m.group(1)])

    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise RenderError(f"the template names {{{{{m.group(1)}}}}}, which the renderer does not fill")
        return str(values[m.group(1)])

    return _PLACEHOLDER.sub(one, _EACH.sub(block, template))


def find_nginx(configured: str | None) -> str:
    """The nginx binary: fleet.nginx, else PATH, else /usr/sbin (Debian's, often not on a user's PATH)."""
    if configured:
        if not os.access(configured, os.X_OK):
            raise RenderError(f"fleet.nginx {configured!r} is not an executable file")
        return configured
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/usr/local/nginx/sbin")
    if not found:
        raise RenderError(NGINX_HINT)
    return found


def supervisor_bin(name: str) -> str:
    """supervisord / supervisorctl next to this Python (the venv's), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise RenderError(f"{name} not found next to {sys.executable} or on PATH: install the supervisor package")
    return found


def _can_cross(path: Path, uid: int, gids: set[int]) -> bool:
    """Whether that user may traverse ``path`` and every folder above it (the x bit that applies to it)."""
    for folder in [path, *path.parents]:
        st = folder.stat()
        bit = 0o100 if st.st_uid == uid else (0o010 if st.st_gid in gids else 0o001)
        if not st.st_mode & bit:
            return False
    return True


def nginx_user(configured: str | None, run_dir: Path) -> tuple[str | None, str | None]:
    """nginx's worker user when the fleet runs as root, and a warning when it must stay root.

    As root, nginx's workers drop to an unprivileged user (www-data, else nobody), who must reach the run
    folder (its temp folders, /health/fleet). Under a private folder (a 0700 home or test folder) they cannot:
    then they stay root, and the warning says how to avoid it. Not root: None, they keep the fleet's user.
    """
    if os.geteuid() != 0:
        return None, None
    for name in ([configured] if configured else ["www-data", "nobody"]):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        gids = {entry.pw_gid, *(g.gr_gid for g in grp.getgrall() if name in g.gr_mem)}
        existing = next(p for p in [run_dir, *run_dir.parents] if p.exists())
        if _can_cross(existing, entry.pw_uid, gids):
            return name, None
        if configured:
            raise RenderError(f"fleet.nginx_user {name!r} cannot reach {run_dir} (a folder above it is private); "
                              "choose a run folder under one other users may cross, such as /tmp")
        return "root", (f"nginx workers run as root: {name} cannot reach {run_dir} (a folder above it is "
                        "private); give a run folder under one other users may cross, such as /tmp")
    raise RenderError(f"fleet.nginx_user {configured!r} does not exist on this host")


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


def worker_settings(fleet: Fleet) -> dict[str, Any]:
    """The workers' shared configuration: the fleet's effective settings, with every path made absolute."""
    s = fleet.settings
    data = s.model_dump(mode="json")
    data.pop("env", None)
    data.pop("fleet", None)
    model_path = resolve_model_path(s.model).resolve()
    data["model"]["path"] = str(model_path)
    # Pinned: a worker restarted after a reload must accept the same reload paths as the others.
    roots = [str(Path(r).expanduser().resolve()) for r in s.model.root] or [str(model_path.parent)]
    data["model"]["root"] = roots
    if s.model.device.startswith("cuda:"):
        data["model"]["device"] = "cuda"  # each worker sees its one GPU as cuda:0
    if s.canary.path:
        data["canary"]["path"] = str(Path(s.canary.path).expanduser().resolve())
    data["models"] = [_entry_paths(entry_tree(e)) for e in s.models]
    data["server"]["admin_key"] = fleet.admin_key
    data["server"]["host"] = "127.0.0.1"
    data["server"]["grpc_port"] = None  # each worker's own, from its environment (worker_environment)
    # Each worker enforces its part of every tenant's limits; nginx spreads requests (least_conn) and passes a 429
    # on to the next worker, so the fleet as a whole admits what the configuration says.
    data["server"]["tenant_limits_fraction"] = s.server.tenant_limits_fraction / len(fleet.layout.workers)
    return data


def _entry_paths(entry: dict[str, Any]) -> dict[str, Any]:
    """One ``models:`` entry as every worker reads it: absolute paths, roots pinned, one GPU as cuda."""
    from inferd.settings import ModelSettings

    settings = ModelSettings.model_validate({k: v for k, v in entry.items() if k in ModelSettings.model_fields})
    path = resolve_model_path(settings).resolve()
    entry["path"] = str(path)
    entry["root"] = [str(Path(r).expanduser().resolve()) for r in settings.root] or [str(path.parent)]
    if settings.device.startswith("cuda:"):
        entry["device"] = "cuda"
    canary = entry.get("canary") or {}
    if canary.get("path"):
        canary["path"] = str(Path(canary["path"]).expanduser().resolve())
    return entry


def redact(data: dict[str, Any]) -> dict[str, Any]:
    """A copy to print: the keys masked, as ``inferd check-config`` masks them."""
    out = json.loads(json.dumps(data))
    for key in SECRET_KEYS:
        if out.get("server", {}).get(key):
            out["server"][key] = "***"
    for tenant in out.get("server", {}).get("tenants") or ():
        tenant["keys"] = ["***"] * len(tenant.get("keys") or ())
    return out


_CONFIG_HEADER = ("# The workers' configuration, written by `inferd fleet` (and rewritten by `inferd fleet reload`,\n"
                  "# canary, promote and rollback, so a restarted worker serves what the others serve).\n"
                  "# server.port, server.admin_port and runtime.torch_threads are each worker's flags, and\n"
                  "# CUDA_VISIBLE_DEVICES / memory.per_process_fraction its environment, in supervisord.conf.\n")


def config_text(data: dict[str, Any]) -> str:
    return _CONFIG_HEADER + yaml.safe_dump(data, sort_keys=False)


def _write(path: Path, text: str, mode: int) -> None:
    """Atomically (a reader never sees half a file), with its permissions set before it is visible."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_worker_config(run_dir: Path, env: str, data: dict[str, Any]) -> None:
    config = run_dir / "config"
    config.mkdir(mode=0o700, exist_ok=True)
    _write(config / "base.yaml", config_text(data), 0o600)
    overlay = config / f"{env}.yaml"
    if not overlay.exists():
        _write(overlay, "# Empty on purpose: base.yaml beside it holds the fleet's effective settings.\n", 0o600)


def read_worker_config(run_dir: Path) -> dict[str, Any]:
    data = yaml.safe_load((run_dir / "config" / "base.yaml").read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise RenderError(f"{run_dir / 'config' / 'base.yaml'} is not a mapping")
    return data


def targets(fleet: Fleet) -> list[dict[str, Any]]:
    """Prometheus file_sd: every worker's /metrics, labelled with the worker and its GPU."""
    return [{"targets": [f"127.0.0.1:{w.port}"],
             "labels": {"job": "inferd", "worker": w.name, "gpu": w.gpu or "cpu",
                        "fleet": f"{fleet.settings.fleet.host}:{fleet.settings.fleet.port}"}}
            for w in fleet.layout.workers]


def new_admin_key(settings: Settings) -> str:
    """The operator's admin key, or a fresh one for this fleet (the workers' admin APIs need one)."""
    return settings.server.admin_key or secrets.token_urlsafe(32)


def check_run_dir(run_dir: Path) -> Path:
    run_dir = run_dir.expanduser().resolve()
    if not _SAFE_PATH.match(str(run_dir)):
        raise RenderError(f"run folder {str(run_dir)!r}: use only letters, digits and . _ / + - in its path "
                          "(nginx and supervisord read paths unquoted)")
    if len(str(run_dir / "supervisor.sock")) > MAX_SOCKET_PATH:
        raise RenderError(f"run folder {run_dir} is too deep: supervisord's socket in it would pass the "
                          f"{MAX_SOCKET_PATH}-byte limit of a unix socket path; choose a shorter one")
    return run_dir


def write_run_dir(fleet: Fleet, meta: Mapping[str, Any]) -> dict[str, Path]:
    """Render every file into the run folder; returns name -> path of what was written."""
    run = fleet.run_dir
    root = os.geteuid() == 0
    # As root, nginx's workers run as another user: they must cross the run folder (not list it) to reach
    # health/ and their temp folders; the secrets stay 0600 below it.
    run.mkdir(parents=True, exist_ok=True)
    os.chmod(run, 0o711 if root else 0o700)
    for sub, mode in (("logs", 0o700), ("prometheus", 0o755), ("health", 0o755), ("nginx", 0o711)):
        (run / sub).mkdir(exist_ok=True)
        os.chmod(run / sub, mode)
    for temp in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        path = run / "nginx" / temp
        path.mkdir(mode=0o700, exist_ok=True)
        if fleet.user:
            entry = pwd.getpwnam(fleet.user)
            os.chown(path, entry.pw_uid, entry.pw_gid)
    files = {"nginx.conf": run / "nginx.conf", "supervisord.conf": run / "supervisord.conf",
             "config": run / "config" / "base.yaml", "targets": run / "prometheus" / "targets.json",
             "layout": run / "layout.json", "admin_key": run / "admin.key", "health": run / "health" / "fleet.json"}
    _write(files["nginx.conf"], render_nginx(fleet), 0o644)
    _write(files["supervisord.conf"], render_supervisord(fleet), 0o600)
    write_worker_config(run, fleet.settings.env, worker_settings(fleet))
    _write(files["targets"], json.dumps(targets(fleet), indent=2) + "\n", 0o644)
    _write(files["admin_key"], fleet.admin_key + "\n", 0o600)
    _write(files["layout"], json.dumps({**meta, **fleet.layout.to_dict(), "status_port": fleet.status_port,
                                        "listen": {"host": fleet.settings.fleet.host,
                                                   "port": fleet.settings.fleet.port},
                                        "env": fleet.settings.env}, indent=2) + "\n", 0o644)
    write_health(run, {"status": "starting", "workers": []})
    return files


def write_health(run_dir: Path, data: Mapping[str, Any]) -> None:
    # World-readable: nginx's worker user serves it.
    _write(run_dir / "health" / "fleet.json", json.dumps(data) + "\n", 0o644)
