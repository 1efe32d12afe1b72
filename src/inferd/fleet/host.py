"""The host a fleet runs on: its nginx and supervisor programs, and the user nginx's workers run as."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import sys
from pathlib import Path

from inferd.fleet.files import RenderError

NGINX_HINT = "nginx is not installed: install it with `apt-get install nginx` (or set fleet.nginx to its path)"


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
