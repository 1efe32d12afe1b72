"""``inferd fleet``: render the run folder, run supervisord in the foreground, stop everything on a signal.

This process is supervisord's parent and nothing more: supervisord starts, restarts and stops the workers and
nginx. What this process adds is the operator's side: the layout and the run folder printed at start, a line
when the fleet is ready, the /health/fleet file (rewritten every second from supervisord and the workers), the
pointer that lets ``inferd fleet status`` find the fleet, and SIGTERM/SIGINT passed on to supervisord, which
stops nginx first (gracefully: requests in flight finish) and then drains the workers. Its exit status is
supervisord's (0 after a clean stop), or 1 if the fleet failed to start.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from inferd.fleet.control import RunDir, pid_alive, pointer_path, status
from inferd.fleet.files import RenderError
from inferd.fleet.host import find_nginx, nginx_user, supervisor_bin
from inferd.fleet.layout import free_port, plan, usable_cores, visible_gpus
from inferd.fleet.render import Fleet, render_nginx, render_supervisord
from inferd.fleet.run_dir import check_run_dir, new_admin_key, write_health, write_run_dir
from inferd.fleet.worker_config import redact, worker_settings
from inferd.settings import Settings

HEALTH_EVERY_S = 2.0
# supervisord's "gave up" state: a worker that could not stay up through startretries tries.
FATAL = "FATAL"


def prepare(settings: Settings, run_dir: Path | None) -> Fleet:
    """Check what the fleet needs (nginx, supervisord), decide the layout and the run folder."""
    nginx = find_nginx(settings.fleet.nginx)
    supervisor_bin("supervisord")
    port = settings.fleet.port
    chosen = run_dir or (Path(settings.fleet.run_dir) if settings.fleet.run_dir else None)
    path = check_run_dir(chosen or Path(tempfile.mkdtemp(prefix=f"inferd-fleet-{port}-")))
    layout_file = path / "layout.json"
    if layout_file.is_file():
        pid = json.loads(layout_file.read_text()).get("fleet_pid")
        if pid and pid != os.getpid() and pid_alive(int(pid)):
            raise RenderError(f"a fleet (pid {pid}) is already running from {path}")
    layout = plan(settings, visible_gpus(), usable_cores())
    status_port = settings.fleet.status_port or free_port()
    user, warning = nginx_user(settings.fleet.nginx_user, path)
    return Fleet(settings, layout, path, status_port, nginx, new_admin_key(settings), user, warning)


def check_nginx(fleet: Fleet) -> None:
    """``nginx -t`` on the rendered file: a config nginx refuses is reported before anything starts."""
    cmd = [fleet.nginx, "-t", "-q", "-e", str(fleet.logs / "nginx-error.log"), "-p", f"{fleet.run_dir}/nginx/",
           "-c", str(fleet.run_dir / "nginx.conf")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RenderError(f"nginx refuses the rendered configuration:\n{(proc.stderr or proc.stdout).strip()}")


def render(fleet: Fleet) -> dict[str, Path]:
    files = write_run_dir(fleet, {"fleet_pid": os.getpid(), "python": sys.executable})
    check_nginx(fleet)
    return files


def print_config(fleet: Fleet, files: dict[str, Path], out: TextIO) -> None:
    import yaml

    s = fleet.settings.fleet
    out.write(f"# inferd fleet: {fleet.layout.summary()}; nginx on {s.host}:{s.port} (least_conn), "
              f"stub_status on 127.0.0.1:{fleet.status_port}\n\n{fleet.layout.table()}\n\n")
    out.write(f"# run folder: {fleet.run_dir} (every file below is written there; nginx -t passed)\n")
    if fleet.warning:
        out.write(f"# warning: {fleet.warning}\n")
    for name, text in (("nginx.conf", render_nginx(fleet)), ("supervisord.conf", render_supervisord(fleet)),
                       ("config/base.yaml (keys masked)", yaml.safe_dump(redact(worker_settings(fleet)),
                                                                          sort_keys=False)),
                       ("prometheus/targets.json", files["targets"].read_text())):
        out.write(f"\n# ---- {name} ----\n{text}")


def _die_with_parent() -> None:
    """In the child before exec: supervisord gets SIGTERM (a clean stop) if this process dies without one."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the operator's process manager must stop supervisord
        pass


def supervisor_env() -> dict[str, str]:
    """supervisord's (and so every worker's) environment: the run folder's files are the whole configuration.

    INFERD_* and MODEL_PATH are dropped: the fleet already folded them into config/base.yaml, and left in the
    environment they would override it, so a worker restarted after a reload would come back on the old model.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("INFERD") and k not in ("MODEL_PATH", "CUDA_VISIBLE_DEVICES")}
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


class Runner:
    def __init__(self, fleet: Fleet, out: TextIO | None = None) -> None:
        self.fleet, self.out = fleet, out or sys.stdout
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.ready_once = False
        self.failed: str | None = None

    def say(self, msg: str) -> None:
        self.out.write(f"inferd fleet: {msg}\n")
        self.out.flush()

    def _signal(self, sig: int, frame: FrameType | None) -> None:
        if not self.stopping:
            self.say(f"{signal.Signals(sig).name} received: stopping nginx (requests in flight finish), "
                     "then draining the workers")
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def supervise(self) -> int:
        fleet = self.fleet
        conf = fleet.run_dir / "supervisord.conf"
        pointer = pointer_path(fleet.settings.fleet.port)
        previous = {s: signal.signal(s, self._signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            # Its own session: a Ctrl-C in the terminal reaches this process only, which stops the fleet in
            # order (nginx first); sent to the whole group it would stop nginx abruptly.
            self.proc = subprocess.Popen([supervisor_bin("supervisord"), "-n", "-c", str(conf)],
                                         env=supervisor_env(), cwd=fleet.run_dir, start_new_session=True,
                                         preexec_fn=_die_with_parent)
            if self.stopping:  # a signal came before supervisord existed to receive it
                self.proc.send_signal(signal.SIGTERM)
            pointer.write_text(json.dumps({"run_dir": str(fleet.run_dir), "pid": os.getpid()}))
            self.say(f"supervisord pid {self.proc.pid}; logs in {fleet.logs}; "
                     f"`inferd fleet status --run-dir {fleet.run_dir}`")
            while self.proc.poll() is None:
                try:
                    self._tick()
                except Exception as exc:  # the health file is a report: never let it take the fleet down
                    self.say(f"health round failed: {type(exc).__name__}: {exc}")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(HEALTH_EVERY_S)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._remove_pointer(pointer)
        rc = self.proc.returncode if self.proc is not None else 1
        write_health(fleet.run_dir, {"status": "stopped", "workers": [], "exit_status": rc})
        if self.failed:
            self.say(f"failed: {self.failed}")
            return 1
        self.say(f"stopped (supervisord exit status {rc})")
        return 0 if rc == 0 else 1

    def _remove_pointer(self, pointer: Path) -> None:
        try:
            if json.loads(pointer.read_text()).get("pid") == os.getpid():
                pointer.unlink()
        except (OSError, ValueError):
            pass

    def _tick(self) -> None:
        """One health round: rewrite /health/fleet, say when ready, give up if a worker cannot start."""
        if self.stopping:
            return
        data = status(RunDir(self.fleet.run_dir), detailed=False, timeout=1.0)
        write_health(self.fleet.run_dir, public_health(data))
        n = data["workers_total"]
        if not self.ready_once and data["ready"] == n and data["nginx"]["state"] == "RUNNING":
            self.ready_once = True
            s = self.fleet.settings.fleet
            self.say(f"ready: {n}/{n} workers behind http://{s.host}:{s.port}")
        if not self.ready_once:
            fatal = [w for w in data["workers"] if w["state"] == FATAL]
            if fatal or data["nginx"]["state"] == FATAL:
                names = [w["name"] for w in fatal] or ["nginx"]
                self.failed = (f"{', '.join(names)} could not start; see {self.fleet.logs}/{names[0]}.log:\n"
                               + _tail(self.fleet.logs / f"{names[0]}.log"))
                self._signal(signal.SIGTERM, None)


def public_health(data: dict[str, Any]) -> dict[str, Any]:
    """What /health/fleet shows (it may face the outside): states and versions, not paths or pids."""
    keep = ("name", "gpu", "state", "ready", "status", "version", "restarts")
    return {"status": data["status"], "ready": data["ready"], "workers_total": data["workers_total"],
            "workers": [{k: w.get(k) for k in keep} for w in data["workers"]],
            "nginx": {"state": data["nginx"]["state"]}, "updated_at": data["updated_at"]}


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def run_fleet(settings: Settings, run_dir: Path | None, print_only: bool, out: TextIO | None = None) -> int:
    out = out or sys.stdout  # looked up now, not at import: a test's captured stdout
    fleet = prepare(settings, run_dir)
    files = render(fleet)
    if print_only:
        print_config(fleet, files, out)
        return 0
    runner = Runner(fleet, out)
    if fleet.warning:
        runner.say(f"warning: {fleet.warning}")
    s = settings.fleet
    runner.say(f"{fleet.layout.summary()}; nginx on http://{s.host}:{s.port} (least_conn); "
               f"run folder {fleet.run_dir}")
    out.write(fleet.layout.table() + "\n")
    return runner.supervise()
