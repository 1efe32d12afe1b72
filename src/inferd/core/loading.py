"""Building a loaded handler from a spec, and the check a client-supplied model path must pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from inferd.core.spec import ModelSpec
from inferd.core.tasks import detect_task, handler_for
from inferd.core.tasks.base import Handler, ModelLoadError, resolve_device


def spec_task(spec: ModelSpec) -> str:
    """The task a spec will serve: as configured, or (``auto``) as the model folder says."""
    return detect_task(spec.path) if spec.task == "auto" else spec.task


def load_handler(spec: ModelSpec) -> Handler:
    """Build the task's handler, load the weights on the device and warm it up."""
    handler: Any = handler_for(spec_task(spec), spec.path)
    handler.load(spec, resolve_device(spec.device))
    if spec.warmup and hasattr(handler, "warmup"):
        handler.warmup()
    return handler


def check_model_path(raw: str, roots: list[Path]) -> Path:
    """Accept only local folders under one of the allowed roots; no URLs, no '..' escapes."""
    if not raw or not isinstance(raw, str):
        raise ModelLoadError("path must be a non-empty string")
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        # A NUL would make the OS calls below raise ValueError; no folder name needs control characters.
        raise ModelLoadError("path must not contain control characters")
    parsed = urlparse(raw)
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter would be a Windows drive
        raise ModelLoadError(f"path {raw!r}: only local folders are allowed, not {parsed.scheme}:// URLs")
    if ".." in Path(raw).parts:
        raise ModelLoadError(f"path {raw!r}: '..' is not allowed")
    try:
        path = Path(raw).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a name too long, a symlink loop, an unknown ~user
        raise ModelLoadError(f"path {raw!r} cannot be resolved: {exc}") from None
    for root in roots:
        if path == root or root in path.parents:
            return path
    allowed = ", ".join(str(r) for r in roots) or "(none)"
    raise ModelLoadError(f"path {raw!r} is not under an allowed model.root ({allowed})")
