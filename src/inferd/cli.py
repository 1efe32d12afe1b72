"""``inferd serve | check-config | bench | fleet | export | prepare | jobs | batch``: flags map onto Settings, then
``start_server(settings)`` (``jobs`` and ``batch``: jobs/cli.py)."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import yaml

from inferd.config import ConfigError, load_settings
from inferd.config_flags import add_config_flags, overrides
from inferd.core.tenants import read_tenants
from inferd.fleet import command as fleet_command
from inferd.hosting import hosted
from inferd.jobs import cli as jobs_cli
from inferd.settings import Settings
from inferd.utils.logger import configure_logging

_SECRETS = ("admin_key", "api_keys", "metrics_key")

# How the serving settings were built (files, env and these flags), so SIGHUP can build them again alike.
_reread: Callable[[], Settings] | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="inferd: a production inference service")
    sub = parser.add_subparsers(dest="command", required=True)
    add_config_flags(sub.add_parser("serve", help="serve the configured model over HTTP"))
    add_config_flags(sub.add_parser("check-config", help="print the effective configuration and exit"))
    sub.add_parser("bench", help="run the benchmark (see bench/README.md)", add_help=False)
    export = sub.add_parser("export", help="export, quantise and gate the model into the cache, then exit "
                                           "(ahead of time: images, init containers)")
    add_config_flags(export, server=False)
    export.add_argument("--output", dest="cache_dir", help="the cache folder to fill (default: model.cache_dir)")
    prepare = sub.add_parser("prepare", help="judge backend auto's candidates into the cache (export, gate, compile) "
                                             "so a server starts warm; exit 0 when the cache is ready")
    add_config_flags(prepare, server=False)
    prepare.add_argument("--output", dest="cache_dir", help="the cache folder to fill (default: model.cache_dir)")
    fleet_command.add_parser(sub)
    jobs_cli.add_parsers(sub)  # `inferd jobs` (a server's batch jobs) and `inferd batch` (one without a server)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    # A managed platform (named, or detected from its variables) dictates the address and its routes (hosting.py).
    return load_settings(args.env, hosted(overrides(args), os.environ), config_dir=args.config_dir)


def redacted(settings: Settings) -> dict[str, Any]:
    data = settings.model_dump(mode="json")
    for key in _SECRETS:
        if data["server"].get(key):
            data["server"][key] = "***"
    for tenant in data["server"].get("tenants") or ():
        tenant["keys"] = ["***"] * len(tenant["keys"])
    if data.get("jobs", {}).get("database_url"):  # postgresql+psycopg://user:PASSWORD@host/db
        data["jobs"]["database_url"] = "***"
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from inferd.bench.run import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "fleet":
        return fleet_command.main(args)
    if args.command == "jobs":
        return jobs_cli.main(args)
    if args.command == "batch":
        # The model's stack (torch, transformers) is imported only for the commands that load a model.
        from inferd.jobs.offline import main as batch_main

        return batch_main(args)
    try:
        settings = settings_from_args(args)
        read_tenants(settings)  # the tenants file too: refused here, not with a traceback at start
    except (ConfigError, ValueError) as exc:
        print(f"inferd: {exc}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        print(yaml.safe_dump(redacted(settings), sort_keys=False), end="")
        return 0
    if args.command in ("export", "prepare"):
        # Their loads log what they do (an export, a broken cache entry built again) as the server's do.
        configure_logging(settings.server.log_level, settings.server.log_format)
    if args.command == "export":
        return export(settings)
    if args.command == "prepare":
        from inferd.prepare import prepare  # the model's stack only for the commands that load a model

        return prepare(settings)
    global _reread
    _reread = functools.partial(settings_from_args, args)
    return start_server(settings)


def export(settings: Settings) -> int:
    """``inferd export``: fill the cache for the configured model and backend, print the entry, exit.

    Exit status 0 when the graph passed the gate (a later start with the same settings is a cache hit),
    1 when it was refused or could not be made (the figures are printed either way), 2 for a configuration the
    server's load refuses before loading anything (a dtype the backend cannot run).
    """
    import dataclasses
    import json

    # The model's stack (torch, transformers) is imported only for the commands that load a model.
    from inferd.core.errors import ModelLoadError
    from inferd.core.loading import load_handler
    from inferd.core.spec import spec_from_settings
    from inferd.prepare import refusal

    if settings.model.backend == "torch":
        print("inferd export: model.backend is torch, which needs no export (give --backend onnx or openvino)",
              file=sys.stderr)
        return 2
    if settings.model.backend == "auto":
        print("inferd export: model.backend is auto, whose candidates `inferd prepare` judges into the cache "
              "(or give --backend onnx or openvino)", file=sys.stderr)
        return 2
    spec = spec_from_settings(settings)
    refused = refusal(spec)
    if refused is not None:  # as the server's load would refuse it, before anything loads
        print(f"inferd export: {refused}", file=sys.stderr)
        return 2
    try:
        handler = load_handler(dataclasses.replace(spec, warmup=False))
    except ModelLoadError as exc:
        print(f"inferd export: {exc}", file=sys.stderr)
        return 1
    info = dict(handler.loaded.backend_info or {})
    handler.close()
    print(json.dumps(info, indent=2))
    return 0


def start_server(settings: Settings) -> int:
    from inferd.server import serve

    code = serve(settings, reread=_reread)
    # The server has drained and closed; the process exits next. Its objects are frozen out of the interpreter's
    # last garbage collection, which with torch and transformers loaded walks millions of them: 1.5-2 s of every
    # stop on a 2-core machine (0.3-0.5 s frozen), in each rolling restart and each test that stops a server.
    # atexit handlers (log handlers, tracing) still run; the memory goes back to the OS with the process.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
