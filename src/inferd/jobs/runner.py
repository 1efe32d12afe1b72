"""The batch runner: in every serving process, ``jobs.concurrency`` loops that claim a batch's next chunk, run its
lines through the app (jobs/lines.py: the online routes, below every online request, as the batch's owner) and
commit the chunk's results with the batch's progress (jobs/store.py: exactly once across a crash). Between chunks
it finishes batches (the output and error files assembled from the committed chunks), moves cancelled and expired
ones to their final state, deletes files and jobs past ``jobs.expiry_s``, and refreshes the job metrics.

The store opens on first use (a batch route's call, or a store that already exists at start-up), so a server that
never runs a job makes no data folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.applications import Starlette

from inferd.api.services import services_of
from inferd.core.tenants import Tenancy
from inferd.jobs.files import FileStore, new_id
from inferd.jobs.lines import LineRunner, Record, bad, endpoint_of, parse_all, split
from inferd.jobs.store import Claim, Store, decoded
from inferd.settings import JobsSettings
from inferd.utils.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

# A line answered "not now" (429: its owner's limits; 503, 504) runs again after this many seconds, as long as
# some line of its chunk gets through; after this many rounds in a row with none, the answers are the records.
RETRY_WAIT_S = 1.0
RETRIES = 30
# Seconds between expiry sweeps and metric refreshes.
SWEEP_S = 5.0
# The error record of a line a batch finished without running (OpenAI's codes for the expired ones).
UNRUN = {"expired": ("batch_expired", "this request could not be executed before the completion window expired"),
         "cancelled": ("batch_cancelled", "the batch was cancelled before this request ran")}
# Their result file's place among the chunks' (write_result's seq): after every chunk, as the file is assembled.
UNRUN_SEQ = 99_999_999


class Stopped(Exception):
    """A chunk's batch cannot go on (its input file is gone, its owner removed): the batch was moved to its end."""


class JobRunner:
    def __init__(self, settings: JobsSettings, app: Starlette, tenancy: Tenancy, metrics: Metrics) -> None:
        self.settings = settings
        self.tenancy = tenancy
        self.metrics = metrics
        self.app = app
        self.lines = LineRunner(app, settings.lines_in_flight)
        self.files = FileStore(settings.data_dir)
        self.worker = f"w-{secrets.token_hex(6)}"  # this process's leases
        self._store: Store | None = None
        self._opening = threading.Lock()
        # The store's and the disk's calls on threads of their own: a slow database never holds the default pool
        # that online requests tokenise on.
        self._pool = ThreadPoolExecutor(settings.concurrency + 2, thread_name_prefix="inferd-jobs")
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._swept = 0.0
        self._held: set[tuple[str, int]] = set()

    # -- the store, opened on first use ----------------------------------------------------------------------

    def store(self) -> Store:
        with self._opening:  # the first calls may come from several threads at once
            if self._store is None:
                self._store = Store.at(self.settings.data_dir, self.settings.database_url)
            return self._store

    def _exists(self) -> bool:
        return self._store is not None or self.settings.database_url is not None \
            or (self.settings.data_dir / "jobs.sqlite3").exists()

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def wake(self) -> None:
        """Work was added: idle loops look at once."""
        self._wake.set()

    # -- start and stop --------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._exists():
            try:
                await self._io(self.store)  # migrations at start-up
            except Exception:  # a database down must not keep online traffic from being served: the loops retry
                log.exception("batch jobs: the job store could not be opened; retrying in the background")
        self._tasks = [asyncio.create_task(self._loop(), name=f"jobs-{i}") for i in range(self.settings.concurrency)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._store is not None:
            store = self._store
            for batch_id, seq in list(self._held):  # another worker takes them now, not after the lease
                await self._io(store.release_chunk, batch_id, seq, self.worker)
            self._held.clear()
            store.close()
        self._pool.shutdown(wait=False)

    # -- the loop --------------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                claim = await self._io(lambda: self.store().claim(self.worker, self.settings.lease_s)) \
                    if self._exists() else None
                if claim is None:
                    await self._sweep()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
                    continue
                await self._run(claim)
                await self._finish_ready()
                await self._sweep()  # the metrics and expiry while jobs run too (at most every SWEEP_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # a store or disk failure: this chunk waits for its lease, the loop goes on
                log.exception("batch runner: a chunk failed; retrying after a pause")
                await asyncio.sleep(self.settings.poll_s)

    async def _run(self, claim: Claim) -> None:
        batch = claim.batch
        key = (batch["id"], claim.seq)
        self._held.add(key)
        renewing = asyncio.create_task(self._renew(batch["id"], claim.seq))
        try:
            started = time.perf_counter()
            try:
                records = await self._records(claim)
            finally:
                renewing.cancel()
            name = await self._io(self.files.write_result, batch["id"], claim.seq, records)
            ok = sum(r.ok for r in records)
            failed = len(records) - ok
            committed = await self._io(lambda: self.store().commit_chunk(batch["id"], claim.seq, self.worker, name,
                                                                          ok, failed))
        except asyncio.CancelledError:
            raise  # stopping: stop() gives the chunk back at once
        except Stopped:
            self._held.discard(key)
            await self._io(lambda: self.store().release_chunk(batch["id"], claim.seq, self.worker))
            return
        except BaseException:
            self._held.discard(key)  # its lease runs out; any worker takes it then
            raise
        self._held.discard(key)
        if not committed:  # another worker took the chunk (its results count), or the batch ended meanwhile
            await self._io(self.files.remove_result, batch["id"], name)
            log.warning("batch %s: chunk %d was taken by another worker or the batch ended; its result here is "
                        "dropped", batch["id"], claim.seq)
            return
        self.metrics.job_lines.labels("ok").inc(ok)
        self.metrics.job_lines.labels("failed").inc(failed)
        elapsed = time.perf_counter() - started
        if records and elapsed > 0:
            self.metrics.job_lines_rate.set(len(records) / elapsed)

    async def _renew(self, batch_id: str, seq: int) -> None:
        """While a chunk runs, its lease is renewed every third of jobs.lease_s: a slow chunk stays this worker's,
        a dead worker's chunk is free again within one lease."""
        while True:
            await asyncio.sleep(self.settings.lease_s / 3)
            if not await self._io(lambda: self.store().renew(batch_id, seq, self.worker, self.settings.lease_s)):
                return

    async def _records(self, claim: Claim) -> list[Record]:
        """Every line of the chunk's span as a record: bad lines' errors, and the valid lines' answers."""
        batch = claim.batch
        owner = batch["owner"]
        tenant = self.tenancy.tenants.get(owner) if owner else None
        if owner and tenant is None and self.tenancy.enabled:
            # Its tenant was removed (a SIGHUP): its lines would run as no one, past every limit of its own.
            await self._stop(batch, "cancelling", "tenant_removed",
                             f"tenant {owner!r} is no longer configured; its batch stops", None)
        try:
            data = await self._io(self.files.read_span, batch["input_file_id"], claim.start, claim.stop)
        except FileNotFoundError:
            await self._stop(batch, "failed", "input_file_missing",
                             f"the input file {batch['input_file_id']!r} is gone from jobs.data_dir", "input_file_id")
        endpoint = endpoint_of(batch["endpoint"])
        lines, records = parse_all(split(data), claim.first_line, endpoint, batch["id"],
                                   frozenset(decoded(batch["duplicates"]) or ()))
        pending = lines
        idle = 0
        while pending:
            answered = await self.lines.route_lines(pending, endpoint, tenant, batch["id"])
            final = [r for r in answered if not r.retry]
            # While the server drains every line is refused "draining": that is no sign the lines cannot run, and
            # a drain longer than RETRIES rounds committed them as failures. The chunk waits; the stop that ends the
            # drain gives it back to the store, to run again after the restart (or on another worker).
            idle = 0 if final or services_of(self.app).engine.draining else idle + 1
            if idle > RETRIES:  # nothing got through for that long: the last answers are the records
                records.extend(answered)
                break
            records.extend(final)
            retried = {r.number for r in answered if r.retry}
            pending = [line for line in pending if line.number in retried]
            if pending:
                log.info("batch %s: %d lines of chunk %d answered 'not now' (%s); again in %g s", batch["id"],
                         len(pending), claim.seq, sorted({r.status for r in answered if r.retry}), RETRY_WAIT_S)
                await asyncio.sleep(RETRY_WAIT_S)
        return records

    async def _stop(self, batch: dict[str, Any], status: str, code: str, message: str, param: str | None) -> None:
        """The batch moved to ``status`` (cancelling: it finishes as cancelled, with its unrun lines' records; failed:
        at once) with the reason in its ``errors``; raises Stopped."""
        errors = [{"code": code, "message": message, "param": param, "line": None}]
        if await self._io(lambda: self.store().set_status(batch["id"], status, expected=("in_progress",),
                                                          errors=errors)):
            log.error("batch %s: %s (%s)", batch["id"], status, message, extra={"batch": batch["id"], "state": status})
            if status == "failed":  # no output: what its chunks did goes with it
                await self._io(self.files.remove_results, batch["id"])
            self.wake()
        raise Stopped(code)

    # -- finishing -------------------------------------------------------------------------------------------

    async def _finish_ready(self) -> None:
        for batch in await self._io(lambda: self.store().to_finish()):
            await self._io(self._finish, batch)

    def _finish(self, batch: dict[str, Any]) -> None:
        """The batch's final state, with its output and error files (what its committed chunks hold)."""
        store = self.store()
        status = batch["status"]
        if status == "cancelling":
            final = "cancelled"
        elif status == "in_progress" and batch["expires_at"] < time.time() \
                and batch["completed"] + batch["failed"] < batch["total"]:
            final = "expired"
        else:
            final = "completed"
            if status == "in_progress" and store.set_status(batch["id"], "finalizing", expected=("in_progress",)):
                log.info("batch %s: finalizing", batch["id"], extra={"batch": batch["id"], "state": "finalizing"})
        results = store.results(batch["id"])
        fresh = store.batch(batch["id"], None) or batch
        output_id, error_id = new_id("file-"), new_id("file-")
        try:
            # The lines it never ran, each an error record: every input line has one.
            unrun = self._unrun(batch, final) if final in UNRUN else []
            extra = [self.files.write_result(batch["id"], UNRUN_SEQ, unrun)] if unrun else []
            out_bytes, err_bytes = self.files.assemble(batch["id"], [*results, *extra], output_id, error_id)
        except FileNotFoundError:
            return  # another worker finished it and removed the chunks' files (or its input file is gone)
        now = time.time()
        base = {"owner": batch["owner"], "purpose": "batch_output", "created_at": now,
                "expires_at": now + self.settings.expiry_s}
        output = {**base, "id": output_id, "filename": f"{batch['id']}_output.jsonl", "bytes": out_bytes,
                  "lines": fresh["completed"]} if fresh["completed"] else None
        failed = fresh["failed"] + len(unrun)
        errors = {**base, "id": error_id, "filename": f"{batch['id']}_error.jsonl", "bytes": err_bytes,
                  "lines": failed} if failed else None
        if store.finish(batch["id"], final, output, errors, results, len(unrun)):
            for file_id, row in ((output_id, output), (error_id, errors)):
                if row is None:
                    self.files.remove(file_id)
            self.files.remove_results(batch["id"])
            log.info("batch %s: %s (%d ok, %d failed of %d)", batch["id"], final, fresh["completed"],
                     fresh["failed"], fresh["total"], extra={"batch": batch["id"], "state": final})
        else:
            self.files.remove(output_id)
            self.files.remove(error_id)
            for name in extra:
                self.files.remove_result(batch["id"], name)

    def _unrun(self, batch: dict[str, Any], final: str) -> list[Record]:
        """The records of the lines of the batch's chunks not done: a bad line's own error, the others ``final``'s."""
        code, message = UNRUN[final]
        endpoint = endpoint_of(batch["endpoint"])
        duplicates = frozenset(decoded(batch["duplicates"]) or ())
        out: list[Record] = []
        for start, stop, first in self.store().undone(batch["id"]):
            try:
                data = self.files.read_span(batch["input_file_id"], start, stop)
            except FileNotFoundError:  # removed from jobs.data_dir by hand: finished without them, not never
                log.warning("batch %s: its input file %s is gone; its unrun lines get no record", batch["id"],
                            batch["input_file_id"])
                return out
            lines, records = parse_all(split(data), first, endpoint, batch["id"], duplicates)
            out += records
            out += [bad(line.number, line.custom_id, code, message, batch["id"]) for line in lines]
        return out

    # -- sweeps ----------------------------------------------------------------------------------------------

    async def _sweep(self) -> None:
        """At most every SWEEP_S: batches to finish, files and jobs past their expiry, the metrics."""
        if not self._exists() or time.monotonic() - self._swept < SWEEP_S:
            return
        self._swept = time.monotonic()
        await self._finish_ready()
        await self._io(self._expire)
        store = self.store()
        counts = await self._io(store.counts)
        for state in ("validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired",
                      "cancelled"):
            self.metrics.jobs.labels(state).set(counts.get(state, 0))
        self.metrics.job_backlog.set(await self._io(store.backlog))

    def _expire(self) -> None:
        store = self.store()
        file_ids, batch_ids = store.old(time.time() - self.settings.expiry_s)
        if not file_ids and not batch_ids:
            return
        store.forget(file_ids, batch_ids)
        for file_id in file_ids:
            self.files.remove(file_id)
        for batch_id in batch_ids:
            self.files.remove_results(batch_id)
        log.info("jobs expired: %d files, %d batches", len(file_ids), len(batch_ids))
