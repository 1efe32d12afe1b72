"""``inferd batch IN --out OUT``: a batch file through the model in this process, with no server, resumable.

The lines are checked and parsed by jobs/lines.py and run by its LineRunner through the app itself (created
here, its lifespan run, no port opened), so every output record is the one a server's batch job writes for the
same line: the same routes, validation and engine call. The run goes chunk by chunk, two in flight so the
scheduler is never idle between them; each chunk is committed in input order (output fsynced, then the
checkpoint replaced: jobs/checkpoint.py), so ``kill -9`` at any moment and the same command again finish the file
with every line in the output exactly once. The checkpoint names the input and, once it has loaded, the model
(``model_fingerprint``): a resume with another model or other settings that change its answers is refused, as its
lines would mix two models' outputs. OUT holds every line's record in input order, answered or failed
(the server's output and error files together); the exit status is 0 when every line was answered, 1 when some
failed (their records say why), 2 when the run was refused (a bad file, a checkpoint of another run, a model
that did not load, another run writing the same OUT), 130 when it was interrupted (Ctrl-C; the same command
resumes).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import shutil
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from tqdm import tqdm

from inferd.api.app import LoadFailed, create_app
from inferd.api.services import services_of
from inferd.config import ConfigError, load_settings
from inferd.config_flags import overrides
from inferd.core.backends.factory import folder_digest
from inferd.core.memory import MemoryGuard, configure_process
from inferd.jobs import checkpoint
from inferd.jobs.checkpoint import Checkpoint, CheckpointError
from inferd.jobs.lines import (
    Endpoint,
    FileRefused,
    Line,
    LineRunner,
    Record,
    check_file,
    duplicates_in,
    endpoint_of,
    parse_all,
    split,
)
from inferd.jobs.tables import (
    BadFile,
    JsonlOutput,
    ParquetOutput,
    check_parquet_input,
    is_parquet,
    jsonl_lines,
    parquet_lines,
    parquet_output,
)
from inferd.settings import Settings
from inferd.utils.logger import configure_logging

# Chunks running at once: while one finishes its last, part-filled batches, the next fills the scheduler.
IN_FLIGHT = 2
# A line answered "not now" (429, 503, 504) runs again, waiting up to this long between rounds ...
_RETRY_MAX_WAIT_S = 1.0
# ... and after this many rounds in a row that answered nothing, its record says why (never a silent gap).
_RETRY_ROUNDS = 600
# No jobs store of its own (the checkpoint is its state); a model that fails to load ends the run.
_OFFLINE = {"jobs.enabled": False, "model.exit_on_load_failure": True}


class ModelNotLoaded(Exception):
    """A model that did not load: the run is refused (exit 2), the reason on one line."""


def offline_settings(args: argparse.Namespace) -> Settings:
    """The settings the flags and files give, as a serverless run needs them: no jobs store, no keys or tenants (no
    port is open: the run is this process's only caller, and no tenant's limits apply to it), models loaded first."""
    given = {**overrides(args, server=False), **_OFFLINE}
    if args.log_level is None:
        given["server.log_level"] = "WARNING"  # the progress bar is the run's output; warnings still show
    settings = load_settings(args.env, given, config_dir=args.config_dir)
    # Set on the object: a None override means "not given" to the loader, so it could not clear tenants_file.
    server = settings.server.model_copy(update={"api_keys": (), "tenants": (), "tenants_file": None})
    # Every model loaded before the first line (each ``models:`` entry too, whatever its own load_mode): the
    # checkpoint names the models that answer (model_fingerprint), and a failed load is the run's refusal.
    eager = {"load_mode": "eager"}
    models = tuple(e.model_copy(update={"model": e.model.model_copy(update=eager)}) for e in settings.models)
    return settings.model_copy(update={"server": server, "model": settings.model.model_copy(update=eager),
                                       "models": models})


def main(args: argparse.Namespace) -> int:
    try:
        settings = offline_settings(args)
        configure_logging(settings.server.log_level, settings.server.log_format)
        return asyncio.run(batch_file(args, settings, configure_process(settings)))
    except (ConfigError, ValueError, BadFile, CheckpointError, ModelNotLoaded, OSError) as exc:
        print(f"inferd batch: {exc}", file=sys.stderr)  # OSError: a file it could not read or write
        return 2
    except FileRefused as exc:
        print(f"inferd batch: {args.input}: {exc.message} ({exc.code})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # asyncio.run cancelled the run: the chunks in flight were stopped uncommitted, so the checkpoint is where
        # the same command goes on from. 130: a shell's status for SIGINT, apart from 1 (lines failed).
        try:
            found = checkpoint.load(args.out)
        except CheckpointError:
            found = None
        print(f"inferd batch: interrupted after {found.lines_done if found else 0} lines; run the same command to "
              "resume", file=sys.stderr)
        return 130


@dataclass
class Source:
    """The input's lines, as jobs/lines.py numbers them, from a checkpoint's place on."""

    path: Path
    parquet: bool
    endpoint: Endpoint

    def lines(self, number: int, offset: int) -> Iterator[tuple[int, bytes, int]]:
        if self.parquet:
            return parquet_lines(self.path, self.endpoint.path, number)
        return jsonl_lines(self.path, number, offset)

    def check(self, max_line_bytes: int) -> tuple[int, frozenset[int]]:
        """The whole-file checks a server's upload gets: the number of lines (blank ones are none) and the lines
        whose custom_id an earlier line has. The file is read whole for them once, as an upload is."""
        if self.parquet:
            check_parquet_input(self.path)
            raws = [raw for _, raw, _ in self.lines(0, 0)]
            total = check_file(b"\n".join(raws), max_line_bytes)
        else:
            data = self.path.read_bytes()
            total = check_file(data, max_line_bytes)
            raws = split(data)
        return total, duplicates_in(raws)


def source_of(path: Path, endpoint: Endpoint) -> Source:
    return Source(path, is_parquet(path), endpoint)


def _start(args: argparse.Namespace, source: Source, total: int) -> Checkpoint:
    """The checkpoint this run starts from: a fresh one, or the one beside OUT when it is this run's."""
    out: Path = args.out
    wanted = Checkpoint(checkpoint.file_sha256(source.path), source.path.stat().st_size, source.endpoint.path,
                        total)
    if args.restart:
        checkpoint.remove(out)
        out.unlink(missing_ok=True)
        shutil.rmtree(out.with_name(out.name + ".parts"), ignore_errors=True)
        return wanted
    found = checkpoint.load(out)
    if found is None:
        if out.exists():
            raise BadFile(f"{out} exists and no checkpoint is beside it (a finished run?); give --restart to "
                          "replace it, or another --out")
        return wanted
    checkpoint.check_resumable(found, wanted, out)
    return found


async def batch_file(args: argparse.Namespace, settings: Settings, memory_guard: MemoryGuard | None = None) -> int:
    """The run ``args`` asks for (IN, --out, --endpoint, --chunk-lines, --restart, --no-progress); its exit status."""
    endpoint = endpoint_of(args.endpoint)
    if not args.input.is_file():
        raise BadFile(f"{args.input}: no such file")
    if args.chunk_lines < 1:
        raise BadFile("--chunk-lines must be at least 1")
    if args.out.resolve() == args.input.resolve():
        raise BadFile(f"--out {args.out} is the input file; the output goes to a file of its own")
    if not args.out.parent.is_dir():
        raise BadFile(f"--out {args.out}: no folder {args.out.parent}")
    with _exclusive(args.out):
        return await _run(args, settings, memory_guard, endpoint)


@contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """OUT to this run alone, for the whole run: two runs on one OUT wrote the same files and one died renaming the
    other's. ``OUT.lock`` is held with flock (the kernel lets it go with the process, kill -9 included) and holds the
    holder's pid; a second run is refused at once."""
    path = out.with_name(out.name + ".lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise BadFile(f"{out} is being written by another inferd batch (pid {holder}); wait for it to end, or "
                          "give another --out") from None
        # The run before may have removed the file it held between our open and our flock: the lock must be on the
        # file now at the path, or a third run would lock another one beside ours.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: see above
        os.close(fd)


async def _run(args: argparse.Namespace, settings: Settings, memory_guard: MemoryGuard | None,
               endpoint: Endpoint) -> int:
    source = source_of(args.input, endpoint)
    total, duplicates = source.check(settings.jobs.max_line_bytes)
    cp = _start(args, source, total)
    job = f"offline-{cp.input_sha256[:16]}"  # record ids are the job's and the line's: equal in a resumed run
    lines = source.lines(cp.next_line, cp.in_offset)
    if cp.finished:  # stopped after its last chunk, before the checkpoint's removal: only the end is left to do
        output = _output(args.out, cp)
    else:
        app = create_app(settings, memory_guard=memory_guard)
        async with AsyncExitStack() as stack:
            try:  # the model loads here: the bar starts after it
                await stack.enter_async_context(app.router.lifespan_context(app))
            except LoadFailed as exc:  # its exit status (3) is a server's; the reason is the ModelLoadError's
                raise ModelNotLoaded(f"the model did not load: {' '.join(str(exc.__cause__ or exc).split())}") from exc
            model = model_fingerprint(app)
            if cp.model is None:  # a fresh run: its checkpoint names the model from now on
                cp = replace(cp, model=model)
                checkpoint.save(args.out, cp)
            else:
                checkpoint.check_same_model(cp, model, args.out)
            # OUT only now, its checkpoint beside it: a run stopped before (killed, or its model did not load) leaves
            # neither, and the same command starts afresh instead of taking OUT for a finished run's.
            output = _output(args.out, cp)
            with tqdm(total=total, initial=cp.lines_done, unit="line", file=sys.stderr, dynamic_ncols=True,
                      disable=args.no_progress, desc=args.out.name) as bar:
                runner = LineRunner(app, settings.jobs.lines_in_flight)
                cp = await _run_chunks(runner, _chunks(lines, args.chunk_lines), endpoint, job, duplicates, cp,
                                       output, args.out, bar)
    output.finish(cp.parts)
    checkpoint.remove(args.out)
    output.clean_up()
    print(f"inferd batch: {cp.lines_done} lines, {cp.lines_done - cp.failed} answered, {cp.failed} failed "
          f"-> {args.out}", file=sys.stderr)
    return 1 if cp.failed else 0


# What a load's description says that changes its answers (not its load time, device or id, which change per load).
_DESCRIBED = ("path", "task", "backend", "dtype", "quantize", "pooling", "normalize", "max_seq_length", "dimension",
              "prompts", "default_prompt_name", "matryoshka_dimensions", "similarity_fn_name", "labels", "multi_label",
              "outputs")
# Settings that change answers and that a description does not carry.
_SET = ("truncate", "chunking", "input_type_prompts", "sparse_top_k", "sparse_threshold", "rerank_instruction")


def model_fingerprint(app: FastAPI) -> dict[str, Any]:
    """What decides each served model's outputs, as its load describes it (core/slots.py) and its settings say, with
    its folder's content digest (the one the export cache keys on; computed once per process): a key per fact,
    ``<model>.<fact>`` (``<model>/canary.<fact>`` for a canary), in JSON types, so a checkpoint compares equal."""
    found: dict[str, Any] = {}
    for served in services_of(app).engine.registry:
        configured = served.settings.model
        slots = served.manager.slots()
        if not slots:  # eager loads (offline_settings) are done or have failed by now: never an empty fingerprint
            why = served.manager.reason or served.manager.state
            raise ModelNotLoaded(f"model {served.name!r} is not loaded ({why})")
        for role, slot in slots:
            d = slot.description
            prefix = served.name if role == "active" else f"{served.name}/{role}"
            facts = {field: getattr(d, field) for field in _DESCRIBED}
            path = Path(d.path)
            facts["content"] = (folder_digest(path) if path.is_dir()
                                else checkpoint.file_sha256(path) if path.is_file() else None)
            if configured.backend == "auto":  # its runtime changes during the run: the setting is what is held
                facts["backend"], facts["dtype"], facts["quantize"] = "auto", configured.dtype, configured.quantize
            facts |= {field: getattr(configured, field) for field in _SET}
            if role == "canary":
                facts["weight"] = served.settings.canary.weight
            found |= {f"{prefix}.{field}": value for field, value in facts.items()}
    # As JSON gives it back (tuples as lists, mappings as dicts, settings objects as dicts).
    return json.loads(json.dumps(found, default=_plain))


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "items"):
        return dict(value.items())
    raise TypeError(f"{type(value).__name__} in a model fingerprint")


def _output(out: Path, cp: Checkpoint) -> JsonlOutput | ParquetOutput:
    return ParquetOutput(out, cp.parts) if parquet_output(out) else JsonlOutput(out, cp.out_bytes)


@dataclass
class _Chunk:
    first: int  # its first line's number
    raws: list[bytes]
    next_line: int
    in_offset: int


def _chunks(lines: Iterator[tuple[int, bytes, int]], size: int) -> Iterator[_Chunk]:
    """Chunks of ``size`` lines that are not blank (blank ones ride along, answered by nothing)."""
    chunk: _Chunk | None = None
    count = 0
    for number, raw, offset in lines:
        if chunk is None:
            chunk = _Chunk(number, [], number, 0)
        chunk.raws.append(raw)
        chunk.next_line, chunk.in_offset = number + 1, offset
        count += bool(raw.strip())
        if count == size:
            yield chunk
            chunk, count = None, 0
    if chunk is not None:
        yield chunk


async def _run_chunks(runner: LineRunner, chunks: Iterator[_Chunk], endpoint: Endpoint, job: str,
                      duplicates: frozenset[int], cp: Checkpoint, output: JsonlOutput | ParquetOutput, out: Path,
                      bar: tqdm) -> Checkpoint:
    # Chunks run overlapped and commit in input order.
    flying: deque[tuple[_Chunk, list[Record], asyncio.Task[list[Record]]]] = deque()
    try:
        for chunk in chunks:
            valid, bad = parse_all(chunk.raws, chunk.first, endpoint, job, duplicates)
            flying.append((chunk, bad, asyncio.create_task(_answer(runner, valid, endpoint, job))))
            if len(flying) >= IN_FLIGHT:
                cp = await _commit(*flying.popleft(), cp, output, out, bar)
        while flying:
            cp = await _commit(*flying.popleft(), cp, output, out, bar)
    finally:
        # A chunk that failed (or an interrupt) leaves the next one running: stopped, never committed.
        for _, _, task in flying:
            task.cancel()
        await asyncio.gather(*(task for _, _, task in flying), return_exceptions=True)
    return cp


async def _commit(chunk: _Chunk, bad: list[Record], task: asyncio.Task[list[Record]], cp: Checkpoint,
                  output: JsonlOutput | ParquetOutput, out: Path, bar: tqdm) -> Checkpoint:
    records = sorted([*bad, *await task], key=lambda r: r.number)
    output.write_chunk(records, cp.parts)
    failed = sum(not r.ok for r in records)
    cp = cp.advanced(len(records), failed, chunk.next_line, chunk.in_offset, output.size, cp.parts + 1)
    checkpoint.save(out, cp)
    bar.update(len(records))
    bar.set_postfix(failed=cp.failed, refresh=False)
    return cp


async def _answer(runner: LineRunner, lines: Sequence[Line], endpoint: Endpoint, job: str) -> list[Record]:
    """Every line's record; a "not now" answer runs its line again (the last one is recorded after many rounds)."""
    answered: list[Record] = []
    pending = list(lines)
    wait, idle = 0.02, 0
    while pending:
        records = await runner.route_lines(pending, endpoint, None, job)
        final = [r for r in records if not r.retry]
        answered += final
        again = {r.number for r in records if r.retry}
        idle = 0 if final else idle + 1
        if idle >= _RETRY_ROUNDS:
            return answered + [r for r in records if r.retry]
        pending = [line for line in pending if line.number in again]
        if pending:
            await asyncio.sleep(wait)
            wait = min(_RETRY_MAX_WAIT_S, wait * 2)
    return answered
