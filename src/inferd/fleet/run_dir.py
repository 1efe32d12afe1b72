"""The run folder: every file a fleet runs from, written into one folder (fleet/render.py renders the two
programs' files, fleet/worker_config.py the workers' configuration).

Layout of a run folder (every path nginx and supervisord use lies inside it):

    nginx.conf  supervisord.conf  layout.json  admin.key (0600)
    config/<base.yaml, <env>.yaml>   the workers' configuration (0600: it holds the keys)
    prometheus/targets.json          file_sd targets: one per worker, labels worker and gpu
    health/fleet.json                what nginx serves at /health/fleet (rewritten by the running fleet)
    nginx/                           nginx's pid and temp folders;  logs/  every log;  supervisor.sock
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inferd.fleet.files import RenderError, write_file
from inferd.fleet.render import Fleet, render_nginx, render_supervisord
from inferd.fleet.worker_config import worker_settings, write_worker_config
from inferd.settings import Settings

# Paths go into nginx and supervisord files unquoted: keep to characters neither reads specially.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9._/+-]+$")
# sun_path holds 108 bytes on Linux (104 on BSDs), terminating NUL included.
MAX_SOCKET_PATH = 103


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
    write_file(files["nginx.conf"], render_nginx(fleet), 0o644)
    write_file(files["supervisord.conf"], render_supervisord(fleet), 0o600)
    write_worker_config(run, fleet.settings.env, worker_settings(fleet))
    write_file(files["targets"], json.dumps(targets(fleet), indent=2) + "\n", 0o644)
    write_file(files["admin_key"], fleet.admin_key + "\n", 0o600)
    write_file(files["layout"], json.dumps({**meta, **fleet.layout.to_dict(), "status_port": fleet.status_port,
                                        "listen": {"host": fleet.settings.fleet.host,
                                                   "port": fleet.settings.fleet.port},
                                        "env": fleet.settings.env}, indent=2) + "\n", 0o644)
    write_health(run, {"status": "starting", "workers": []})
    return files


def write_health(run_dir: Path, data: Mapping[str, Any]) -> None:
    # World-readable: nginx's worker user serves it.
    write_file(run_dir / "health" / "fleet.json", json.dumps(data) + "\n", 0o644)
