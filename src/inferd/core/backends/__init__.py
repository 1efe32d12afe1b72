"""Runtimes for the forward pass: torch eager, ONNX Runtime, OpenVINO (see base.py for the contract)."""

from __future__ import annotations

from inferd.core.backends.base import BackendError, BackendOptions, Runner, options_for
from inferd.core.backends.export import open_backend

__all__ = ["BackendError", "BackendOptions", "Runner", "open_backend", "options_for"]
