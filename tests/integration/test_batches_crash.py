"""Exactly once across kill -9 (issue 42 item 3): a 20,000-line batch whose server is killed (SIGKILL) at random
moments of the job, three times, and started again on the same data folder: the output holds every line exactly
once. Then two workers sharing a PostgreSQL job store (Debian's postgresql, started here with initdb in a
temporary folder on a free port, as the ``postgres`` user: initdb refuses root): one is killed mid-job, the other
finishes it. And the store's own rules on PostgreSQL, where they rest on row locks rather than SQLite's one writer:
a schema 1 store migrated, a file a running batch reads kept, a batch of a deleted file refused, a late commit
counting nothing.

A short lease (jobs.lease_s 2) frees a killed worker's chunks two seconds after its last renewal.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from batchkit import create, embedding_lines, jsonl, records, upload, wait_final
from conftest import Server, metric_value, wait_for
from servers import free_port, start_server
from sqlalchemy import select
from tinymodel import write_tiny_bert

from inferd.jobs.store import SCHEMA_VERSION, FileGone, Store, chunks

PG_BIN = Path("/usr/lib/postgresql/15/bin")
LINES = 20_000


def _env(model: Path, data: Path, **extra: str) -> dict[str, str]:
    return {"INFERD__MODEL__PATH": str(model), "INFERD__MODEL__LOAD_MODE": "eager", "INFERD__CACHE__MAX_ENTRIES": "0",
            "INFERD__SERVER__ACCESS_LOG": "false", "INFERD__JOBS__DATA_DIR": str(data),
            "INFERD__JOBS__LEASE_S": "2", "INFERD__JOBS__POLL_S": "0.2", **extra}


def _done(server: Server, batch_id: str) -> int:
    counts = httpx.get(f"{server.url}/v1/batches/{batch_id}", timeout=30).json()["request_counts"]
    return counts["completed"] + counts["failed"]


def _exactly_once(client: httpx.Client, batch: dict, n: int, prefix: str) -> None:
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}, batch
    ids = Counter(r["custom_id"] for r in records(client, batch["output_file_id"]))
    assert sum(ids.values()) == n and set(ids) == {f"{prefix}{i}" for i in range(n)}
    assert ids.most_common(1)[0][1] == 1


def test_kill_9_three_times_during_a_job_loses_and_doubles_no_line(tmp_path: Path) -> None:
    model = write_tiny_bert(tmp_path / "bert", seed=21)
    env = _env(model, tmp_path / "data")
    server = start_server(tmp_path, env, wait="/health/ready")
    try:
        with server.client() as client:
            batch_id = create(client, upload(client, jsonl(embedding_lines(LINES, "k"))).json()["id"]).json()["id"]
        rng = random.Random(42)
        # Kill points at random fractions of the job, in order: each kill lands while the job is running.
        for target in sorted(rng.uniform(0.1, 0.8) * LINES for _ in range(3)):
            wait_for(lambda t=target, s=server: _done(s, batch_id) >= t, 240, f"{int(target)} lines done")
            assert _done(server, batch_id) < LINES  # killed mid-job, chunks in flight
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            server = start_server(tmp_path, env, wait="/health/ready")
        with server.client() as client:
            _exactly_once(client, wait_final(client, batch_id, 300), LINES, "k")
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture
def postgres() -> Iterator[str]:
    """A PostgreSQL server of its own on a free port, trust auth on 127.0.0.1; its URL. Always stopped."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"PostgreSQL 15 is not installed at {PG_BIN} (.ci/run installs Debian's postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="inferd-pg-"))
    shutil.chown(folder, "postgres", "postgres")
    data, port = folder / "data", free_port()

    def as_postgres(*args: str) -> None:
        # initdb refuses root; the tests run as root here and in CI.
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *args], check=True, capture_output=True, timeout=120)

    try:
        as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(folder / "log"), "-w", "-t", "60",
                    "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        finally:
            as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_two_workers_share_a_postgresql_store_and_one_finishes_what_the_other_left(tmp_path: Path,
                                                                                  postgres: str) -> None:
    n = 6000
    model = write_tiny_bert(tmp_path / "bert", seed=22)
    env = _env(model, tmp_path / "data", INFERD__JOBS__DATABASE_URL=postgres)
    first = start_server(tmp_path, env, wait="/health/ready")
    second = start_server(tmp_path, env, wait="/health/ready")
    try:
        with first.client() as client:
            batch_id = create(client, upload(client, jsonl(embedding_lines(n, "w"))).json()["id"]).json()["id"]
        wait_for(lambda: _done(first, batch_id) >= n // 4, 100, "a quarter of the lines done")
        ran_second_before = metric_value(httpx.get(second.url + "/metrics").text, "inferd_job_lines_total",
                                         outcome="ok")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        with second.client() as client:
            try:
                batch = wait_final(client, batch_id, 150)  # within pytest's timeout: a failure says where it was
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nthe survivor's log:\n{second.log()[-6000:]}") from None
            _exactly_once(client, batch, n, "w")
            ran_second = metric_value(client.get("/metrics").text, "inferd_job_lines_total", outcome="ok")
        assert ran_second > ran_second_before  # the survivor ran what was left
    finally:
        first.stop(signal.SIGKILL)
        second.stop()


def test_a_server_stopped_mid_job_gives_its_running_chunks_back(tmp_path: Path) -> None:
    """SIGTERM (a rollout's stop): the chunks it was running go back to pending at once, for any worker, instead
    of waiting out their lease (600 s here)."""
    model = write_tiny_bert(tmp_path / "bert", seed=23)
    server = start_server(tmp_path, _env(model, tmp_path / "data", INFERD__JOBS__LEASE_S="600"), wait="/health/ready")
    try:
        with server.client() as client:
            batch_id = create(client, upload(client, jsonl(embedding_lines(LINES, "s"))).json()["id"]).json()["id"]
        wait_for(lambda: _done(server, batch_id) >= 256, 120, "a chunk done")
    finally:
        assert server.stop() == 0
    store = Store.at(tmp_path / "data", None)
    try:
        with store.engine.connect() as conn:
            states = Counter(state for (state,) in conn.execute(select(chunks.c.state)))
    finally:
        store.close()
    assert states["running"] == 0 and states["pending"] > 0, states


def test_the_store_s_rules_hold_on_postgresql_and_a_schema_1_store_is_migrated(postgres: str) -> None:
    now = time.time()
    batch = {"id": "b1", "owner": "", "endpoint": "/v1/embeddings", "input_file_id": "file-x",
             "completion_window": "24h", "status": "in_progress", "created_at": now, "in_progress_at": now,
             "expires_at": now + 86400, "total": 2, "completed": 0, "failed": 0, "metadata": None, "duplicates": []}
    old = Store(postgres)
    old.add_file({"id": "file-x", "owner": "", "purpose": "batch", "filename": "in.jsonl", "bytes": 20, "lines": 2,
                  "created_at": now, "expires_at": None})
    old.add_batch(batch, [(0, 10, 0), (10, 20, 1)])
    with old.engine.begin() as conn:  # the store as schema 1 made it
        conn.exec_driver_sql("ALTER TABLE inferd_batches DROP COLUMN errors")
        conn.exec_driver_sql("UPDATE inferd_jobs_meta SET value = 1 WHERE key = 'schema'")
    old.close()
    one, two = Store(postgres), Store(postgres)  # the first migrates it, the second finds it done
    try:
        with one.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT value FROM inferd_jobs_meta").scalar() == SCHEMA_VERSION
        assert one.batch("b1", "")["errors"] is None and two.delete_file("file-x", "") == "in_use"
        running = one.claim("w1", 60)
        assert running is not None
        errors = [{"code": "tenant_removed", "message": "gone", "param": None, "line": None}]
        assert two.set_status("b1", "cancelling", "", ("in_progress",), errors=errors)
        assert one.batch("b1", "")["errors"] == errors
        assert two.finish("b1", "cancelled", None, None, [], unrun=2)
        assert not one.commit_chunk("b1", running.seq, "w1", "late", 1, 0)  # the batch ended under it
        assert one.batch("b1", "")["completed"] == 0
        assert two.delete_file("file-x", "") == "deleted"
        with pytest.raises(FileGone):
            one.add_batch({**batch, "id": "b2"}, [(0, 10, 0)])
        assert one.batch("b2", None) is None
    finally:
        one.close()
        two.close()


def test_a_drain_longer_than_the_line_retries_commits_no_job_line_as_a_failure(tmp_path: Path) -> None:
    """A job's lines are refused "draining" while the server drains, and the runner retried a refused line for
    RETRIES rounds (about 31 s) before committing the refusal as the line's record: a drain longer than that (a long
    document still running, server.drain_timeout_s 60) turned the running chunk's lines into failed lines of the
    batch instead of giving the chunk back for the restart."""
    model = write_tiny_bert(tmp_path / "bert", seed=23)
    # lifecycle_fakes:SlowEmbedding is that tiny BERT at 0.1 s a batch.
    server = start_server(tmp_path, _env(model, tmp_path / "data", INFERD__MODEL__TASK="lifecycle_fakes:SlowEmbedding",
                                         LIFECYCLE_DELAY_S="0.1", INFERD__BATCHING__MAX_BATCH_SIZE="1",
                                         INFERD__JOBS__CHUNK_SIZE="32", INFERD__JOBS__LINES_IN_FLIGHT="4",
                                         INFERD__SERVER__DRAIN_TIMEOUT_S="60",
                                         INFERD__BATCHING__DEFAULT_TIMEOUT_MS="100000"), wait="/health/ready")
    # A document of about 340 pieces, one a batch: 34 s of online work the drain waits for.
    doc = " ".join(f"word{i} alpha beta gamma." for i in range(680))
    answers: list[httpx.Response] = []
    try:
        with server.client() as client:
            batch_id = create(client, upload(client, jsonl(embedding_lines(2000, "d"))).json()["id"]).json()["id"]
        wait_for(lambda: _done(server, batch_id) >= 32, 120, "a chunk done")

        def post() -> None:
            with server.client(timeout=120) as c:
                answers.append(c.post("/v1/embeddings", json={"input": [doc], "chunking": {"mode": "pooled",
                                                                                           "max_tokens": 32}}))

        sender = threading.Thread(target=post)
        sender.start()
        time.sleep(1.5)  # the document accepted, its first waves run (the job's lines are in flight too)
        server.proc.send_signal(signal.SIGTERM)
        sender.join(120)
        assert server.proc.wait(70) == 0
    finally:
        server.stop(signal.SIGKILL)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    store = Store.at(tmp_path / "data", None)
    try:
        batch = store.batch(batch_id, None)
    finally:
        store.close()
    assert batch is not None and batch["failed"] == 0 and batch["completed"] >= 32, batch
