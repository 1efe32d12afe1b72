"""The configuration flags every command that builds Settings takes (``inferd serve``, ``check-config``,
``export``, ``fleet``): their argparse definitions and the settings key each one sets.

Its own module so that the CLI and ``inferd fleet`` (fleet/command.py) both build on it, not on each other.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from inferd.config import RawValue
from inferd.settings import BACKENDS, DTYPES, LOAD_MODES, LOG_FORMATS, LOG_LEVELS, PLATFORMS, QUANTIZE

# flag name -> dotted settings key
FLAGS = {
    "host": "server.host",
    "port": "server.port",
    "admin_port": "server.admin_port",
    "platform": "server.platform",
    "log_format": "server.log_format",
    "log_level": "server.log_level",
    "model_path": "model.path",
    "model_version": "model.version",
    "load_mode": "model.load_mode",
    "device": "model.device",
    "dtype": "model.dtype",
    "backend": "model.backend",
    "quantize": "model.quantize",
    "cache_dir": "model.cache_dir",
    "calibration_file": "model.calibration_file",
    "max_batch_size": "batching.max_batch_size",
    "max_wait_ms": "batching.max_wait_ms",
    "torch_threads": "runtime.torch_threads",
}
# The flags of a server's own address: `inferd fleet` gives every worker its own, and its --host/--port are nginx's.
SERVER_ONLY = ("host", "port", "admin_port")


def add_config_flags(p: argparse.ArgumentParser, server: bool = True) -> None:
    p.add_argument("--env", help="configuration overlay (default: $INFERD_ENV or dev)")
    p.add_argument("--config-dir", type=Path, help="folder holding base.yaml and the overlays")
    if server:
        p.add_argument("--host")
        p.add_argument("--port", type=int)
        p.add_argument("--admin-port", type=int)
        p.add_argument("--platform", choices=PLATFORMS,
                       help="also answer a managed platform's routes (SageMaker: /ping, /invocations; Vertex AI: "
                            "AIP_PREDICT_ROUTE, AIP_HEALTH_ROUTE) on its port; detected from its environment "
                            "variables when not given (docs/platforms.md)")
    p.add_argument("--log-format", choices=LOG_FORMATS)
    p.add_argument("--log-level", choices=LOG_LEVELS)
    p.add_argument("--model-path", help="a local Hugging Face model folder")
    p.add_argument("--model-version")
    p.add_argument("--load-mode", choices=LOAD_MODES)
    p.add_argument("--device")
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--backend", choices=BACKENDS)
    p.add_argument("--quantize", choices=QUANTIZE)
    p.add_argument("--cache-dir", help="where exported graphs are kept (model.cache_dir)")
    p.add_argument("--calibration-file", help="texts for int8 calibration and the accuracy gate, one per line")
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-wait-ms", type=float)
    p.add_argument("--torch-threads", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="any setting by its dotted key, e.g. batching.max_wait_ms=5 or, for one model of a "
                        "models: list, models.<name>.backend=openvino (repeatable; values read as YAML)")


def overrides(args: argparse.Namespace, server: bool = True) -> dict[str, Any]:
    """The dotted settings keys the flags set (None where a flag was not given); without ``server``, the
    SERVER_ONLY flags are left out (a fleet's --host/--port mean nginx's address)."""
    out = {key: getattr(args, flag, None) for flag, key in FLAGS.items() if server or flag not in SERVER_ONLY}
    for item in getattr(args, "settings", None) or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. models.reranker.backend=openvino")
        out[key.strip()] = RawValue(raw)  # read by the key's type, as an environment variable's value is
    return out
