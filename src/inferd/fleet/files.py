"""The files a run folder is made of: the deploy/ templates read and filled, and a file written atomically."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_EACH = re.compile(r"^#@each (\w+)\n(.*?)^#@end\n", re.S | re.M)


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


def write_file(path: Path, text: str, mode: int) -> None:
    """Atomically (a reader never sees half a file), with its permissions set before it is visible."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
