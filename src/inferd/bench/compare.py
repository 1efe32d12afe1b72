"""``inferd bench --compare REV[,REV...]``: the same load against several git revisions, in alternating rounds.

Each revision is checked out in a worktree of its own and served by ``python -m inferd.cli serve`` from that
worktree's ``src`` and ``configs``, with a venv built from that revision's runtime lock (keyed by its content, so
revisions with the same lock share one; pip's wheel cache makes a new one a matter of minutes). ``.`` stands for
the working tree as it is, uncommitted changes included: the way to compare a change against main before it
lands. Every server is started once and stays up for the whole run; a round loads each in turn (the order
reversed every other round, so a drift of the machine's load falls on both sides), with a closed loop (texts/s)
and an open loop at one fixed rate for all (latency percentiles).

The verdict on each revision against the first, per figure: *slower (or faster) beyond noise* when every round
of one lies beyond every round of the other. For two identical servers each of the C(2n, n) orderings of their
2n round figures is equally likely, and only one puts all of B's below all of A's: with the default 4 rounds
that happens by chance 1 time in 70 (1.4 %), with 3 rounds 1 in 20. Otherwise *within noise*, and the paired
ratio per round (B's figure over A's in the same round) says by how much, with its range.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from inferd import corpus as bench_corpus
from inferd.bench.load import Target, TextSource, run_closed, run_open
from inferd.bench.procs import ROOT, ServerFailed, ServerProc, start_inferd

WORKTREE = "."
# Figures compared, and whether more is better.
# server_cpu_ms_per_text: the server process's CPU time (every thread, user + system) over the closed loop, per
# text answered. Throughput on a shared 2-core machine drifts by 10-20 % between rounds; what a request costs
# the server drifts far less, so an overhead cut too small to show in texts/s shows here.
FIGURES = {"texts_per_s": True, "server_cpu_ms_per_text": False, "open_p50_ms": False, "open_p99_ms": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("comparing revisions (--compare)")
    g.add_argument("--compare", type=lambda s: [r.strip() for r in s.split(",") if r.strip()], metavar="REV,REV",
                   help="git revisions to compare (the first is the reference; '.' = the working tree as it is); "
                        "runs only this comparison")
    g.add_argument("--compare-rounds", type=int, default=4, help="alternating rounds (default 4)")
    g.add_argument("--compare-concurrency", type=int, default=32, help="closed-loop users (default 32)")
    g.add_argument("--compare-rate", type=float,
                   help="open-loop requests/s for every revision (default: half the reference's first round)")
    g.add_argument("--compare-dir", type=Path,
                   help="worktrees and venvs (default $XDG_CACHE_HOME/inferd/compare, kept between runs)")


# -- pure parts ---------------------------------------------------------------------------------------------------


def round_order(names: Sequence[str], r: int) -> list[str]:
    """Round r's order: as given on even rounds, reversed on odd ones (ABAB, then BA.. : drift falls on both)."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def verdict(ref: Sequence[float], other: Sequence[float], higher_is_better: bool) -> str:
    """'slower beyond noise' / 'faster beyond noise' when every round of one lies beyond every round of the
    other (a permutation test: 1 / C(2n, n) by chance), else 'within noise'. 'slower' means worse."""
    if not ref or not other:
        return "no data"
    if max(other) < min(ref):
        return "slower beyond noise" if higher_is_better else "faster beyond noise"
    if min(other) > max(ref):
        return "faster beyond noise" if higher_is_better else "slower beyond noise"
    return "within noise"


def summary(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def compare_figures(rounds: dict[str, list[dict[str, float]]], names: Sequence[str]) -> dict[str, Any]:
    """Per revision and figure: median and range over rounds, paired ratio to the reference, verdict."""
    ref = names[0]
    out: dict[str, Any] = {}
    for name in names:
        rows: dict[str, Any] = {}
        for fig, higher in FIGURES.items():
            mine = [r[fig] for r in rounds[name] if r.get(fig) is not None]
            theirs = [r[fig] for r in rounds[ref] if r.get(fig) is not None]
            paired = [a[fig] / b[fig] for a, b in zip(rounds[name], rounds[ref], strict=True)
                      if a.get(fig) is not None and b.get(fig)]
            rows[fig] = {**summary(mine), "ratio": summary(paired),
                         "verdict": "reference" if name == ref else verdict(theirs, mine, higher)}
        out[name] = rows
    return out


def venv_key(lock_texts: Sequence[str]) -> str:
    """A venv per distinct runtime lock (and this Python): revisions that lock the same packages share one."""
    h = hashlib.sha256(f"{sys.version_info[0]}.{sys.version_info[1]}".encode())
    for text in lock_texts:
        h.update(b"\0" + text.encode())
    return h.hexdigest()[:16]


# -- revisions: worktree, venv, server ----------------------------------------------------------------------------


@dataclass
class Revision:
    name: str  # as asked
    sha: str  # or "working tree"
    tree: Path
    python: Path


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _lock(tree: Path) -> str:
    path = tree / "requirements.txt"
    return path.read_text() if path.is_file() else ""


_MISSING = re.compile(r"No module named '([A-Za-z0-9_.]+)'")


def _complete_imports(tree: Path, python: Path, say: Callable[[str], None]) -> None:
    """Install what the revision's server imports but its runtime lock forgot (as its dev lock pins it).

    Revisions from the fleet's landing to its fix imported httpx at start without locking it: `make run` failed
    there, and its tests passed only because the dev lock brought httpx.
    """
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    dev = tree / "requirements-dev.txt"
    for _ in range(5):
        # `serve --help` builds the whole parser, which imports what every subcommand needs at start.
        proc = subprocess.run([str(python), "-c", "import inferd.server, sys; from inferd.cli import main; "
                               "sys.argv = ['inferd', 'serve', '--help']; main()"], env=env, cwd=tree,
                              capture_output=True, text=True)
        missing = _MISSING.search(proc.stderr)
        if proc.returncode == 0 or missing is None:
            return
        module = missing.group(1).split(".")[0]
        pin = re.search(rf"^({re.escape(module)}==\S+)", dev.read_text(), re.M | re.I) if dev.is_file() else None
        if pin is None:
            raise RuntimeError(f"{tree.name}: inferd imports {module}, which neither lock pins:\n{proc.stderr[-2000:]}")
        say(f"{tree.name}: its runtime lock lacks {module}; installing {pin.group(1)} from its dev lock")
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", pin.group(1)],
                       check=True, cwd=tree)


def prepare(rev: str, base: Path, say: Callable[[str], None]) -> Revision:
    if rev == WORKTREE:
        tree, sha = ROOT, "working tree"
    else:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
        tree = base / "worktrees" / sha[:12]
        if not (tree / "src" / "inferd").is_dir():
            say(f"{rev}: worktree at {tree}")
            shutil.rmtree(tree, ignore_errors=True)
            _git("worktree", "prune")
            _git("worktree", "add", "--detach", "--force", str(tree), sha)
    venv = base / "venvs" / venv_key([_lock(tree)])
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        say(f"{rev}: building venv {venv} from its runtime lock (pip's wheel cache is reused)")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r",
                        str(tree / "requirements.txt")], check=True, cwd=tree)
        (venv / ".complete").touch()
    _complete_imports(tree, python, say)
    grpc = tree / "src" / "inferd" / "grpc"
    if (grpc / "build.py").is_file() and not (grpc / "_gen" / "__init__.py").is_file():
        # The gRPC stubs are generated at install (git-ignored), and the server imports them at start.
        say(f"{rev}: generating its gRPC stubs")
        subprocess.run([str(python), "-m", "inferd.grpc.build"], check=True, cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree / "src")})
    return Revision(rev, sha, tree, python)


def start(rev: Revision, logs: Path, model: Path | None, torch_threads: int | None,
          extra_env: dict[str, str], timeout: float = 300.0) -> ServerProc:
    """That revision's ``inferd serve`` (its own code, configs and venv), as ``start_inferd`` starts ours."""
    label = rev.sha[:12] if rev.sha != "working tree" else "worktree"
    return start_inferd(logs, model, torch_threads, extra_env, timeout=timeout, tree=rev.tree, python=rev.python,
                        name=f"compare-{label}")


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


# -- the run ------------------------------------------------------------------------------------------------------


def compare_revisions(args: argparse.Namespace, say: Callable[[str], None], logs: Path, command: str) -> dict[str, Any]:
    names: list[str] = list(args.compare)
    if len(names) < 2 or len(set(names)) != len(names):
        raise SystemExit("inferd bench --compare: give two or more distinct revisions, e.g. --compare main,.")
    if args.compare_rounds < 2:
        raise SystemExit("inferd bench --compare: --compare-rounds must be 2 or more")
    base = args.compare_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferd" / "compare"
    base.mkdir(parents=True, exist_ok=True)
    revs = {name: prepare(name, base, say) for name in names}
    texts = bench_corpus.texts(args.corpus_size, args.seed)
    tokens = [bench_corpus.estimate_tokens(t) for t in texts]
    extra = {"INFERD__MODEL__DEVICE": args.device, **dict(args.server_env)}
    servers: dict[str, ServerProc] = {}
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    rate = args.compare_rate
    failed: dict[str, str] = {}
    try:
        for name in list(names):
            say(f"{name} ({revs[name].sha[:12]}): starting inferd serve")
            try:
                servers[name] = start(revs[name], logs, args.model, args.torch_threads, extra)
            except ServerFailed as exc:
                # A revision that cannot serve (a broken commit, a setting it does not know) is left out.
                say(f"{name}: left out, it does not serve: {str(exc)[-600:]}")
                failed[name] = str(exc)[-2000:]
                names.remove(name)
                del rounds[name]
        if len(names) < 2:
            raise SystemExit(f"inferd bench --compare: fewer than two revisions serve: {failed}")
        for r in range(args.compare_rounds):
            for name in round_order(names, r):
                target = Target(servers[name].url, client=args.client, api_key=args.api_key)
                proc = psutil.Process(servers[name].proc.pid)
                cpu = _cpu_seconds(proc)
                closed = run_closed(target, TextSource(texts, tokens, seed=args.seed + r),
                                    args.compare_concurrency, 1, args.duration, args.warmup)
                # The warm-up's share is taken off in proportion to its length (same load, same rate).
                spent = (_cpu_seconds(proc) - cpu) * args.duration / (args.duration + args.warmup)
                if rate is None:
                    rate = round(closed["texts_per_s"] / 2, 1)
                    say(f"open-loop rate for every revision: {rate} req/s (half {name}'s first round)")
                opened = run_open(target, TextSource(texts, tokens, seed=args.seed + 100 + r), rate,
                                  args.open_duration, min(args.warmup, 2.0), seed=args.seed + r)
                errors = sum(closed["errors"].values()) + sum(opened["errors"].values())
                row = {"texts_per_s": closed["texts_per_s"],
                       "server_cpu_ms_per_text": round(1e3 * spent / max(closed["texts"], 1), 3),
                       "closed_p50_ms": closed["p50_ms"],
                       "closed_p99_ms": closed["p99_ms"], "open_p50_ms": opened["p50_ms"],
                       "open_p99_ms": opened["p99_ms"], "errors": errors,
                       "mean_batch_size": closed.get("mean_batch_size")}
                rounds[name].append(row)
                say(f"round {r + 1}/{args.compare_rounds} {name}: {row['texts_per_s']:.1f} texts/s at "
                    f"c={args.compare_concurrency}, {row['server_cpu_ms_per_text']} server CPU ms/text; "
                    f"open {rate} req/s P50 {row['open_p50_ms']} ms, P99 {row['open_p99_ms']} ms"
                    + (f"; {errors} errors" if errors else ""))
    finally:
        for server in servers.values():
            server.stop()
    return {"command": command, "revisions": {n: {"sha": revs[n].sha, "tree": str(revs[n].tree)} for n in names},
            "rounds": rounds, "open_rate": rate, "concurrency": args.compare_concurrency,
            "duration_s": args.duration, "open_duration_s": args.open_duration,
            "figures": compare_figures(rounds, names), "failed": failed, "logs": str(logs)}


def markdown(result: dict[str, Any]) -> str:
    names = list(result["revisions"])
    lines = [f"`{result['command']}`", "",
             f"Closed loop: {result['concurrency']} users, 1 text/request, {result['duration_s']:g} s a round; open "
             f"loop: {result['open_rate']} req/s for every revision, {result['open_duration_s']:g} s a round; "
             f"{len(result['rounds'][names[0]])} alternating rounds. Median (range) over rounds; the ratio is to "
             f"{names[0]} in the same round.", "",
             "| revision | figure | median | range | ratio to first (range) | verdict |", "|---|---|---|---|---|---|"]
    for name in names:
        sha = result["revisions"][name]["sha"][:12]
        for fig, row in result["figures"][name].items():
            ratio = row["ratio"]
            lines.append(f"| {name} ({sha}) | {fig} | {row['median']} | {row['min']}–{row['max']} | "
                         f"{ratio['median']} ({ratio['min']}–{ratio['max']}) | {row['verdict']} |")
    per_round = ["{}: {}".format(n, ", ".join(f"{r['texts_per_s']:.1f}" for r in result["rounds"][n])) for n in names]
    lines += ["", "Per round (texts/s): " + "; ".join(per_round)]
    lines += [f"Left out (does not serve): {n}" for n in result.get("failed", {})]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace, command: str, say: Callable[[str], None]) -> int:
    logs = args.logs or Path(tempfile.mkdtemp(prefix=f"inferd-compare-{time.strftime('%Y%m%d-%H%M%S')}-"))
    logs.mkdir(parents=True, exist_ok=True)
    result = compare_revisions(args, say, logs, command)
    args.out.mkdir(parents=True, exist_ok=True)
    md, js = args.out / "compare.md", args.out / "compare.json"
    md.write_text(markdown(result))
    js.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result), flush=True)
    print(f"wrote {md} and {js}", flush=True)
    return 1 if any(r["errors"] for rows in result["rounds"].values() for r in rows) else 0

