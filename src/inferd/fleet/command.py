"""The argparse side of ``inferd fleet`` and its actions (reload, canary, promote, rollback, shadow, status).

``inferd fleet`` takes the usual configuration flags (passed on to every worker through the rendered
configuration), except that --host/--port are nginx's. The actions find a running fleet by --run-dir,
$INFERD_FLEET_RUN_DIR, or the pointer the fleet on --port (default fleet.port) leaves in the temp folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from inferd.config import ConfigError, load_settings
from inferd.config_flags import add_config_flags, overrides
from inferd.fleet.control import FleetNotFound, RunDir, find_run_dir, format_status, status
from inferd.fleet.files import RenderError
from inferd.fleet.rollout import Change, ChangeFailed, Rollout, change_lock
from inferd.fleet.shadow import ShadowChange, ShadowRollout
from inferd.settings import Settings


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("fleet", help="run N workers behind nginx under supervisord (see docs/fleet.md)",
                       description="Run N `inferd serve` workers behind nginx, under supervisord, in the "
                                   "foreground; Ctrl-C / SIGTERM stops everything, drained.")
    add_config_flags(p, server=False)
    p.add_argument("--port", type=int, help="nginx's port (fleet.port, default 8080)")
    p.add_argument("--host", help="nginx's address (fleet.host, default 127.0.0.1)")
    p.add_argument("--workers", type=int, help="number of workers (fleet.workers)")
    p.add_argument("--run-dir", type=Path, help="run folder for the rendered files and logs (default: a new "
                                                "temporary one; for the actions: the running fleet's)")
    p.add_argument("--print-config", action="store_true",
                   help="render into the run folder, print the layout and every file, and exit")
    actions = p.add_subparsers(dest="action", metavar="ACTION")

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help_)
        # SUPPRESS: given before the action (`inferd fleet --run-dir X status`) it must not be reset here.
        a.add_argument("--run-dir", type=Path, default=argparse.SUPPRESS, help="the running fleet's run folder")
        a.add_argument("--port", type=int, default=argparse.SUPPRESS, help="find the fleet running on this port")
        return a

    for name, help_ in (("reload", "switch every worker to another model (all or none)"),
                        ("canary", "give every worker a canary model taking --weight of the traffic")):
        a = action(name, help_)
        a.add_argument("--model", help="which served model (a models: list's name; default: the only one)")
        a.add_argument("--path", required=True, help="model folder (under model.root)")
        a.add_argument("--version", required=True)
        if name == "canary":
            a.add_argument("--weight", type=float, required=True)
            a.add_argument("--force", action="store_true",
                           help="even an embedding model of another space (refused by default: shadow it instead)")
        a.add_argument("--timeout", type=float, default=600.0, help="seconds per worker (loading takes time)")
    for name, help_ in (("promote", "the canary becomes every worker's model"),
                        ("rollback", "drop every worker's canary")):
        a = action(name, help_)
        a.add_argument("--model", help="which served model (a models: list's name; default: the only one)")
        a.add_argument("--timeout", type=float, default=600.0)
    a = action("shadow", "a shadow candidate on every worker (start, stop), its aggregated report, or its "
               "promotion decided on every worker's report (promote)")
    a.add_argument("op", choices=("start", "stop", "report", "promote"))
    a.add_argument("--model", help="which served model (a models: list's name; default: the only one)")
    a.add_argument("--path", help="start: the candidate's model folder (under model.root)")
    a.add_argument("--version", help="start: the candidate's version")
    a.add_argument("--weight", type=float, help="start: the share of live requests mirrored to it")
    a.add_argument("--force", action="store_true", help="promote: even against the drift report (logged)")
    a.add_argument("--timeout", type=float, default=600.0)
    action("status", "each worker's state, readiness, versions, queue depth and restarts").add_argument(
        "--json", action="store_true", help="print JSON")
    return p


def fleet_settings(args: argparse.Namespace) -> Settings:
    # The workers' address flags are not taken (each worker gets its own); --host/--port are nginx's.
    given = overrides(args, server=False)
    given.update({"fleet.port": args.port, "fleet.host": args.host, "fleet.workers": args.workers})
    return load_settings(args.env, given, config_dir=args.config_dir)


def _run_dir(args: argparse.Namespace) -> RunDir:
    port = args.port
    if port is None and args.run_dir is None:
        port = load_settings(args.env, config_dir=args.config_dir).fleet.port
    return RunDir(find_run_dir(args.run_dir, port or 0))


def main(args: argparse.Namespace) -> int:
    try:
        if args.action is None:
            from inferd.fleet.runner import run_fleet

            return run_fleet(fleet_settings(args), args.run_dir, args.print_config)
        run = _run_dir(args)
        if args.action == "status":
            data = status(run)
            print(json.dumps(data, indent=2) if args.json else format_status(data))
            return 0 if data["status"] == "ok" else 1
        if args.action == "shadow":
            return shadow(run, args)
        return change(run, args)
    except (ConfigError, RenderError, FleetNotFound) as exc:
        print(f"inferd fleet: {exc}", file=sys.stderr)
        return 2


def shadow(run: RunDir, args: argparse.Namespace) -> int:
    if args.op == "start" and (not args.path or not args.version or args.weight is None
                               or not 0.0 <= args.weight <= 1.0):
        print("inferd fleet shadow start: --path, --version and --weight (in [0, 1]) are needed", file=sys.stderr)
        return 2
    settings = load_settings(args.env, config_dir=args.config_dir)
    path = str(Path(args.path).expanduser().resolve()) if args.path else None
    ch = ShadowChange(args.op, args.model, path, args.version, args.weight, args.force)

    def say(msg: str) -> None:
        print(f"inferd fleet shadow {args.op}: {msg}", flush=True)

    with httpx.Client(timeout=httpx.Timeout(args.timeout, connect=5.0)) as client:
        rollout = ShadowRollout(run, client, say)
        try:
            if args.op == "report":
                print(json.dumps(rollout.decide(ch, settings.model.gate, shadow_min_items(settings)), indent=2))
                return 0
            with change_lock(run.path):
                answers = rollout.apply_shadow(ch, settings.model.gate, shadow_min_items(settings))
        except ChangeFailed as exc:
            print(f"inferd fleet shadow {args.op}: {exc}", file=sys.stderr)
            return 3 if exc.mixed else 1
    say(f"every worker ({len(answers)}) done")
    return 0


def shadow_min_items(settings: Settings) -> int:
    return settings.shadow.min_items


def change(run: RunDir, args: argparse.Namespace) -> int:
    if args.action == "canary" and not 0.0 <= args.weight <= 1.0:
        print("inferd fleet canary: --weight must lie in [0, 1]", file=sys.stderr)
        return 2
    path = str(Path(args.path).expanduser().resolve()) if getattr(args, "path", None) else None
    ch = Change(args.action, path, getattr(args, "version", None), getattr(args, "weight", None),
                getattr(args, "model", None), bool(getattr(args, "force", False)))

    def say(msg: str) -> None:
        print(f"inferd fleet {args.action}: {msg}", flush=True)

    with httpx.Client(timeout=httpx.Timeout(args.timeout, connect=5.0)) as client:
        try:
            with change_lock(run.path):
                answers = Rollout(run, client, say).apply(ch)
        except ChangeFailed as exc:
            print(f"inferd fleet {args.action}: {exc}", file=sys.stderr)
            return 3 if exc.mixed else 1
    versions = sorted({str((a.get("active") or a.get("canary") or {}).get("version")) for a in answers})
    say(f"every worker ({len(answers)}) done; serving {', '.join(versions)}")
    return 0
