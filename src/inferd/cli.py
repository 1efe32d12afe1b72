"""``inferd serve | check-config | bench | fleet | export``: flags map onto Settings, then ``run(settings)``."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from inferd.config import ConfigError, Settings, load_settings

# flag name -> dotted settings key
FLAGS = {
    "host": "server.host",
    "port": "server.port",
    "admin_port": "server.admin_port",
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

_SECRETS = ("admin_key", "api_keys", "metrics_key")

# How the serving settings were built (files, env and these flags), so SIGHUP can build them again alike.
_reread: Callable[[], Settings] | None = None


def _add_config_flags(p: argparse.ArgumentParser, server: bool = True) -> None:
    p.add_argument("--env", help="configuration overlay (default: $INFERD_ENV or dev)")
    p.add_argument("--config-dir", type=Path, help="folder holding base.yaml and the overlays")
    if server:  # `inferd fleet` gives every worker its own address; its --host/--port are nginx's
        p.add_argument("--host")
        p.add_argument("--port", type=int)
        p.add_argument("--admin-port", type=int)
    p.add_argument("--log-format", choices=["json", "text"])
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--model-path", help="a local Hugging Face model folder")
    p.add_argument("--model-version")
    p.add_argument("--load-mode", choices=["background", "eager", "lazy"])
    p.add_argument("--device")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--backend", choices=["torch", "onnx", "openvino"])
    p.add_argument("--quantize", choices=["none", "int8-weights", "int8"])
    p.add_argument("--cache-dir", help="where exported graphs are kept (model.cache_dir)")
    p.add_argument("--calibration-file", help="texts for int8 calibration and the accuracy gate, one per line")
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-wait-ms", type=float)
    p.add_argument("--torch-threads", type=int)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="inferd: a production inference service")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_flags(sub.add_parser("serve", help="serve the configured model over HTTP"))
    _add_config_flags(sub.add_parser("check-config", help="print the effective configuration and exit"))
    sub.add_parser("bench", help="run the benchmark (see bench/README.md)", add_help=False)
    export = sub.add_parser("export", help="export, quantise and gate the model into the cache, then exit "
                                           "(ahead of time: images, init containers)")
    _add_config_flags(export, server=False)
    export.add_argument("--output", dest="cache_dir", help="the cache folder to fill (default: model.cache_dir)")
    from inferd.fleet.command import add_parser as add_fleet_parser

    add_fleet_parser(sub, _add_config_flags)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {key: getattr(args, flag, None) for flag, key in FLAGS.items()}
    return load_settings(args.env, overrides, config_dir=args.config_dir)


def redacted(settings: Settings) -> dict[str, Any]:
    data = settings.model_dump(mode="json")
    for key in _SECRETS:
        if data["server"].get(key):
            data["server"][key] = "***"
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from inferd.bench.run import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "fleet":
        from inferd.fleet.command import main as fleet_main

        return fleet_main(args)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"inferd: {exc}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        print(yaml.safe_dump(redacted(settings), sort_keys=False), end="")
        return 0
    if args.command == "export":
        from inferd.core.backends.export import export_command

        return export_command(settings)
    global _reread
    _reread = functools.partial(settings_from_args, args)
    return run(settings)


def run(settings: Settings) -> int:
    from inferd.server import serve

    return serve(settings, reread=_reread)


if __name__ == "__main__":
    sys.exit(main())
