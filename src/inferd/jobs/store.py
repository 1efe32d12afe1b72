"""The job store: files' and batches' state, and each batch's chunks, in SQLite (WAL, one file under the data
folder) or PostgreSQL (``jobs.database_url``: several processes or pods share the jobs), through SQLAlchemy Core.

File contents never enter the database (jobs/files.py keeps them on disk); a row names its file. Every call is
synchronous (the runner and the routes call them in a thread) and is one transaction.

Exactly once: a worker claims a chunk (``claim``: the next pending chunk of a running batch, or one whose lease
ran out, its worker dead; ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so two workers never wait on, or take, the same
one), writes its results to a file of its own, then ``commit_chunk`` marks the chunk done, names that file and adds
its counts to the batch's progress, in one transaction, only while the lease is still that worker's. A worker
killed before the commit leaves a file no row names (removed later) and a chunk the next claim takes again; the
output is assembled from the files committed rows name, so no line is lost or doubled.

Every read of a file or a batch is by owner (the tenant's name; "" without tenants): a tenant never sees another's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    and_,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection, Engine

SCHEMA_VERSION = 2
# A batch's states (OpenAI's); the last four are final.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")

metadata = MetaData()
meta = Table("inferd_jobs_meta", metadata, Column("key", String(64), primary_key=True),
             Column("value", Integer, nullable=False))
files = Table(
    "inferd_files", metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), unique=True, nullable=False),
    Column("owner", String(64), nullable=False, index=True),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(512), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("lines", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True),
)
batches = Table(
    "inferd_batches", metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("id", String(64), unique=True, nullable=False),
    Column("owner", String(64), nullable=False, index=True),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    *(Column(f"{state}_at", Float, nullable=True) for state in
      ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
    Column("total", Integer, nullable=False),
    Column("completed", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("output_file_id", String(64), nullable=True),
    Column("error_file_id", String(64), nullable=True),
    Column("metadata", JSON, nullable=True),
    # The line numbers whose custom_id an earlier line has (jobs/lines.py duplicates_in): chunks parse apart.
    Column("duplicates", JSON, nullable=False),
    # Why a batch failed or stopped on its own (OpenAI's ``errors.data``: code, message, line, param); schema 2.
    Column("errors", JSON, nullable=True),
)
chunks = Table(
    "inferd_chunks", metadata,
    Column("batch_id", String(64), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("start", BigInteger, nullable=False),  # byte offsets into the input file
    Column("stop", BigInteger, nullable=False),
    Column("first_line", Integer, nullable=False),
    Column("state", String(16), nullable=False, index=True),  # pending, running, done
    Column("lease_owner", String(64), nullable=True),
    Column("lease_until", Float, nullable=True),
    Column("result", String(256), nullable=True),  # the committed result files' name (jobs/files.py)
    Column("ok", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
)


@dataclass(frozen=True, slots=True)
class Claim:
    """A chunk a worker holds until ``lease_until``, with what it needs of its batch."""

    batch: dict[str, Any]
    seq: int
    start: int
    stop: int
    first_line: int
    lease_until: float


class UnknownCursor(LookupError):
    """A page asked for after an id that names none of the owner's rows."""


class _Undo(Exception):
    """Raised inside a transaction to roll it back."""


class FileGone(LookupError):
    """The input file of a batch being made was deleted meanwhile."""


class Store:
    """One database; ``url`` a SQLAlchemy URL (``sqlite:///path`` or ``postgresql+psycopg://...``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sqlite = url.startswith("sqlite")
        self.engine: Engine = create_engine(url, pool_pre_ping=not self.sqlite)
        if self.sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.migrate()

    @classmethod
    def at(cls, data_dir: Path, database_url: str | None) -> Store:
        """The configured store: ``database_url``, or SQLite under ``data_dir`` (made on first use)."""
        if database_url:
            return cls(database_url)
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{data_dir / 'jobs.sqlite3'}")

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            if self.sqlite:
                # Take the write lock at once: two processes upgrading a read to a write would fail, not wait.
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            yield conn

    def migrate(self) -> None:
        """Tables made, and the schema brought to SCHEMA_VERSION, one step per version (the row locked, so two
        processes starting at once step it once)."""
        metadata.create_all(self.engine, checkfirst=True)
        with self._tx() as conn:
            found = conn.execute(select(meta.c.value).where(meta.c.key == "schema").with_for_update()).scalar()
            if found is None:
                conn.execute(insert(meta).values(key="schema", value=SCHEMA_VERSION))
                return
            if found > SCHEMA_VERSION:
                raise RuntimeError(f"the job store's schema is version {found}; this inferd knows up to "
                                   f"{SCHEMA_VERSION}: upgrade inferd")
            if found < 2:  # 1 -> 2: batches.errors
                kind = "TEXT" if self.sqlite else "JSON"
                conn.exec_driver_sql(f"ALTER TABLE {batches.name} ADD COLUMN errors {kind}")
            if found < SCHEMA_VERSION:
                conn.execute(update(meta).where(meta.c.key == "schema").values(value=SCHEMA_VERSION))

    # -- files ---------------------------------------------------------------------------------------------

    def add_file(self, row: dict[str, Any]) -> None:
        with self._tx() as conn:
            conn.execute(insert(files).values(**row))

    def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            found = conn.execute(select(files).where(files.c.id == file_id, files.c.owner == owner)).mappings().first()
        return dict(found) if found else None

    def files(self, owner: str, purpose: str | None, after: str | None, limit: int,
              ascending: bool = False) -> tuple[list[dict], bool]:
        query = select(files).where(files.c.owner == owner)
        if purpose:
            query = query.where(files.c.purpose == purpose)
        return self._page(files, query, owner, after, limit, ascending)

    def delete_file(self, file_id: str, owner: str) -> str:
        """"deleted", "in_use" (a batch not yet final reads it: kept) or "missing", decided and done in one
        transaction with the file's row locked, as ``add_batch`` locks it: a batch made from the file at the same
        time either sees it gone or keeps it."""
        with self._tx() as conn:
            if conn.execute(select(files.c.id).where(files.c.id == file_id, files.c.owner == owner)
                            .with_for_update()).first() is None:
                return "missing"
            if conn.execute(select(batches.c.id).where(batches.c.input_file_id == file_id,  # a batch not final reads it
                                                       batches.c.status.in_(ACTIVE)).limit(1)).first() is not None:
                return "in_use"
            conn.execute(delete(files).where(files.c.id == file_id, files.c.owner == owner))
        return "deleted"

    # -- batches -------------------------------------------------------------------------------------------

    def add_batch(self, row: dict[str, Any], spans: Sequence[tuple[int, int, int]]) -> None:
        """A batch and its chunks (``spans``: start byte, stop byte, first line), in one transaction; FileGone when
        its input file's row is gone (deleted since it was read: ``delete_file``)."""
        with self._tx() as conn:
            if conn.execute(select(files.c.id).where(files.c.id == row["input_file_id"], files.c.owner == row["owner"])
                            .with_for_update()).first() is None:
                raise FileGone(row["input_file_id"])
            conn.execute(insert(batches).values(**row))
            if spans:
                conn.execute(insert(chunks), [{"batch_id": row["id"], "seq": i, "start": a, "stop": b,
                                               "first_line": first, "state": "pending", "ok": 0, "failed": 0}
                                              for i, (a, b, first) in enumerate(spans)])

    def batch(self, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        """A batch by id, ``owner``'s only (None: any owner's, for the runner)."""
        query = select(batches).where(batches.c.id == batch_id)
        if owner is not None:
            query = query.where(batches.c.owner == owner)
        with self.engine.connect() as conn:
            found = conn.execute(query).mappings().first()
        return dict(found) if found else None

    def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        return self._page(batches, select(batches).where(batches.c.owner == owner), owner, after, limit)

    def _page(self, table: Table, query: Any, owner: str, after: str | None, limit: int,
              ascending: bool = False) -> tuple[list[dict], bool]:
        """Newest first (``ascending``: oldest first); ``after`` an id of the owner's: those past it in that order
        (UnknownCursor when it names none of the owner's); has_more: a further page exists."""
        with self.engine.connect() as conn:
            if after:
                n = conn.execute(select(table.c.n).where(table.c.id == after, table.c.owner == owner)).scalar()
                if n is None:
                    raise UnknownCursor(after)
                query = query.where(table.c.n > n if ascending else table.c.n < n)
            order = table.c.n.asc() if ascending else table.c.n.desc()
            rows = [dict(r) for r in conn.execute(query.order_by(order).limit(limit + 1)).mappings()]
        return rows[:limit], len(rows) > limit

    def set_status(self, batch_id: str, status: str, owner: str | None = None,
                   expected: Sequence[str] = ACTIVE, **values: Any) -> bool:
        """``status`` (stamped ``<status>_at``) if the batch is now in one of ``expected``: a state change is made
        once, by whoever makes it first."""
        query = update(batches).where(batches.c.id == batch_id, batches.c.status.in_(expected))
        if owner is not None:
            query = query.where(batches.c.owner == owner)
        with self._tx() as conn:
            return conn.execute(query.values(status=status, **{f"{status}_at": time.time()}, **values)).rowcount == 1

    def counts(self) -> dict[str, int]:
        """Batches by status, every owner's (the metrics)."""
        with self.engine.connect() as conn:
            return {s: n for s, n in conn.execute(select(batches.c.status, func.count()).group_by(batches.c.status))}

    def backlog(self) -> int:
        """Lines of running batches not yet done."""
        with self.engine.connect() as conn:
            found = conn.execute(select(func.sum(batches.c.total - batches.c.completed - batches.c.failed))
                                 .where(batches.c.status.in_(ACTIVE))).scalar()
        return int(found or 0)

    # -- chunks (the runner) -------------------------------------------------------------------------------

    def claim(self, worker: str, lease_s: float) -> Claim | None:
        """The next chunk to run (the oldest running batch's first pending one, or one whose lease ran out)."""
        now = time.time()
        query = (select(chunks).join(batches, batches.c.id == chunks.c.batch_id)
                 .where(batches.c.status == "in_progress", batches.c.expires_at >= now,
                        or_(chunks.c.state == "pending", and_(chunks.c.state == "running", chunks.c.lease_until < now)))
                 .order_by(batches.c.n, chunks.c.seq).limit(1).with_for_update(skip_locked=True, of=chunks))
        with self._tx() as conn:
            row = conn.execute(query).mappings().first()
            if row is None:
                return None
            until = now + lease_s
            taken = conn.execute(update(chunks).where(
                chunks.c.batch_id == row["batch_id"], chunks.c.seq == row["seq"],
                or_(chunks.c.state == "pending", and_(chunks.c.state == "running", chunks.c.lease_until < now)))
                .values(state="running", lease_owner=worker, lease_until=until)).rowcount
            if taken != 1:
                return None
            batch = conn.execute(select(batches).where(batches.c.id == row["batch_id"])).mappings().one()
        return Claim(dict(batch), row["seq"], row["start"], row["stop"], row["first_line"], until)

    def renew(self, batch_id: str, seq: int, worker: str, lease_s: float) -> bool:
        """The lease of a chunk still running pushed on (False: it is no longer this worker's)."""
        with self._tx() as conn:
            return conn.execute(update(chunks).where(
                chunks.c.batch_id == batch_id, chunks.c.seq == seq, chunks.c.state == "running",
                chunks.c.lease_owner == worker).values(lease_until=time.time() + lease_s)).rowcount == 1

    def commit_chunk(self, batch_id: str, seq: int, worker: str, result: str, ok: int, failed: int) -> bool:
        """The chunk done with its result files and counts, and the batch's progress, at once; False (nothing
        changed) when the lease is no longer this worker's (another took the chunk) or the batch is final already
        (finished as cancelled, expired or failed while the chunk ran: its output is made)."""
        try:
            with self._tx() as conn:
                done = conn.execute(update(chunks).where(
                    chunks.c.batch_id == batch_id, chunks.c.seq == seq, chunks.c.state == "running",
                    chunks.c.lease_owner == worker).values(state="done", result=result, ok=ok, failed=failed,
                                                           lease_owner=None, lease_until=None)).rowcount
                if done != 1:
                    return False
                counted = conn.execute(update(batches).where(batches.c.id == batch_id,
                                                             batches.c.status.in_(ACTIVE)).values(
                    completed=batches.c.completed + ok, failed=batches.c.failed + failed)).rowcount
                if counted != 1:
                    raise _Undo
        except _Undo:
            return False
        return True

    def undone(self, batch_id: str) -> list[tuple[int, int, int]]:
        """The spans (start byte, stop byte, first line) of the batch's chunks not done, in order."""
        with self.engine.connect() as conn:
            return [(a, b, first) for (a, b, first) in conn.execute(
                select(chunks.c.start, chunks.c.stop, chunks.c.first_line).where(
                    chunks.c.batch_id == batch_id, chunks.c.state != "done").order_by(chunks.c.seq))]

    def release_chunk(self, batch_id: str, seq: int, worker: str) -> None:
        """A chunk its worker could not finish (stopping, or an error) back to pending, for anyone."""
        with self._tx() as conn:
            conn.execute(update(chunks).where(chunks.c.batch_id == batch_id, chunks.c.seq == seq,
                                              chunks.c.state == "running", chunks.c.lease_owner == worker)
                         .values(state="pending", lease_owner=None, lease_until=None))

    def results(self, batch_id: str) -> list[str]:
        """The committed chunks' result names, in order."""
        with self.engine.connect() as conn:
            return _results(conn, batch_id)

    def to_finish(self) -> list[dict[str, Any]]:
        """Batches ready to be finished: running or finalizing with every chunk done; cancelling with no chunk
        running under a live lease; running past their completion window."""
        now = time.time()
        with self.engine.connect() as conn:
            open_chunks = select(chunks.c.batch_id).where(chunks.c.state != "done")
            live = select(chunks.c.batch_id).where(chunks.c.state == "running", chunks.c.lease_until >= now)
            # Past its window, a batch is claimed no further (``claim``) and finished once its chunks running end.
            query = select(batches).where(or_(
                and_(batches.c.status.in_(("in_progress", "finalizing")), batches.c.id.not_in(open_chunks)),
                and_(batches.c.status == "cancelling", batches.c.id.not_in(live)),
                and_(batches.c.status == "in_progress", batches.c.expires_at < now, batches.c.id.not_in(live))))
            return [dict(r) for r in conn.execute(query).mappings()]

    def finish(self, batch_id: str, status: str, output: dict | None, errors: dict | None,
               results: Sequence[str], unrun: int = 0) -> bool:
        """The batch's final state, with its output and error files' rows, at once, if no one finished it first and
        its committed chunks are still ``results`` (those the files were made of: a late commit makes them stale,
        and the batch is finished again from the new ones); ``unrun``: lines that never ran, counted failed."""
        try:
            with self._tx() as conn:
                values: dict[str, Any] = {"status": status, f"{status}_at": time.time()}
                for key, row in (("output_file_id", output), ("error_file_id", errors)):
                    if row is not None:
                        values[key] = row["id"]
                if unrun:
                    values["failed"] = batches.c.failed + unrun
                changed = conn.execute(update(batches).where(batches.c.id == batch_id,
                                                             batches.c.status.in_(ACTIVE)).values(**values)).rowcount
                if changed != 1:
                    return False
                if _results(conn, batch_id) != list(results):
                    raise _Undo
                for row in (output, errors):
                    if row is not None:
                        conn.execute(insert(files).values(**row))
        except _Undo:
            return False
        return True

    # -- expiry --------------------------------------------------------------------------------------------

    def old(self, before: float) -> tuple[list[str], list[str]]:
        """Files past their ``expires_at`` or created before ``before`` (``jobs.expiry_s`` ago: lowering it applies
        to the files kept already), but a running batch's input; and final batches created before ``before``."""
        now = time.time()
        with self.engine.connect() as conn:
            in_use = select(batches.c.input_file_id).where(batches.c.status.in_(ACTIVE))
            due = or_(files.c.expires_at < now, files.c.created_at < before)
            old_files = [f for (f,) in conn.execute(select(files.c.id).where(due, files.c.id.not_in(in_use)))]
            old_batches = [b for (b,) in conn.execute(select(batches.c.id).where(
                batches.c.status.in_(FINAL), batches.c.created_at < before))]
        return old_files, old_batches

    def forget(self, file_ids: Sequence[str], batch_ids: Sequence[str]) -> None:
        with self._tx() as conn:
            if file_ids:
                conn.execute(delete(files).where(files.c.id.in_(file_ids)))
            if batch_ids:
                conn.execute(delete(chunks).where(chunks.c.batch_id.in_(batch_ids)))
                conn.execute(delete(batches).where(batches.c.id.in_(batch_ids)))


def _results(conn: Connection, batch_id: str) -> list[str]:
    return [r for (r,) in conn.execute(select(chunks.c.result).where(
        chunks.c.batch_id == batch_id, chunks.c.state == "done").order_by(chunks.c.seq))]


def _sqlite_pragmas(dbapi_conn: Any, _: Any) -> None:
    # WAL: readers never block the writer; the busy timeout waits out another process's write instead of failing;
    # the driver's own transaction handling is off so _tx's BEGIN IMMEDIATE is the transaction.
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def decoded(value: Any) -> Any:
    """A JSON column as read (SQLite's driver may hand back text)."""
    return json.loads(value) if isinstance(value, str) else value
