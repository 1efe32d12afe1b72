"""The job store's guarantees, on SQLite files shared by two Store objects (two processes' view of one store):
a chunk is one worker's at a time; a commit by a worker that lost its lease changes nothing; a dead worker's chunk
is taken again once its lease runs out; a batch is finished once, from the chunks committed when it is; a batch past
its window gives no chunk and a late commit counts nothing; a file read by a running batch is not deleted, and a
batch is not made from a deleted file; owners see only their own; old rows expire; a schema 1 store is migrated.
No server: jobs/store.py alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.jobs.store import SCHEMA_VERSION, FileGone, Store, UnknownCursor


def _file(store: Store, owner: str = "", file_id: str = "file-x") -> None:
    store.add_file({"id": file_id, "owner": owner, "purpose": "batch", "filename": "in.jsonl", "bytes": 30, "lines": 3,
                    "created_at": time.time(), "expires_at": None})


def _batch(batch_id: str, owner: str = "", status: str = "in_progress", total: int = 3) -> dict:
    now = time.time()
    return {"id": batch_id, "owner": owner, "endpoint": "/v1/embeddings", "input_file_id": "file-x",
            "completion_window": "24h", "status": status, "created_at": now, "in_progress_at": now,
            "expires_at": now + 86400, "total": total, "completed": 0, "failed": 0, "metadata": None,
            "duplicates": []}


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    one, two = Store.at(tmp_path, None), Store.at(tmp_path, None)
    _file(one)
    yield one, two
    one.close()
    two.close()


def test_a_chunk_is_one_worker_s_and_a_lost_lease_commits_nothing(stores: tuple[Store, Store]) -> None:
    one, two = stores
    one.add_batch(_batch("b1"), [(0, 10, 0), (10, 20, 1)])
    first, second = one.claim("w1", 60), two.claim("w2", 60)
    assert first is not None and second is not None and {first.seq, second.seq} == {0, 1}
    assert one.claim("w3", 60) is None  # both held
    assert not two.commit_chunk("b1", first.seq, "w2", "r", 1, 0)  # not w2's chunk
    assert one.commit_chunk("b1", first.seq, "w1", "r0", 1, 0)
    assert not one.commit_chunk("b1", first.seq, "w1", "r0", 1, 0)  # done once
    assert one.batch("b1", "")["completed"] == 1
    assert one.to_finish() == []  # a chunk still open


def test_a_dead_worker_s_chunk_is_taken_again_after_its_lease(stores: tuple[Store, Store]) -> None:
    one, two = stores
    one.add_batch(_batch("b2", total=1), [(0, 10, 0)])
    taken = one.claim("dead", 0.2)
    assert taken is not None and two.claim("alive", 60) is None
    time.sleep(0.3)
    again = two.claim("alive", 60)
    assert again is not None and again.seq == taken.seq
    assert not one.renew("b2", taken.seq, "dead", 60)  # the dead worker's lease is gone for good
    assert not one.commit_chunk("b2", taken.seq, "dead", "late", 1, 0)
    assert two.commit_chunk("b2", again.seq, "alive", "r", 1, 0)
    assert [b["id"] for b in one.to_finish()] == ["b2"] and one.results("b2") == ["r"]
    assert not one.finish("b2", "completed", None, None, [])  # made of other chunks than those committed
    assert one.finish("b2", "completed", None, None, ["r"]) and not two.finish("b2", "completed", None, None, ["r"])
    assert one.batch("b2", None)["status"] == "completed"


def test_a_cancelled_batch_gives_no_chunk_and_finishes_once_its_running_chunks_end(
        stores: tuple[Store, Store]) -> None:
    one, two = stores
    one.add_batch(_batch("b3"), [(0, 10, 0), (10, 20, 1), (20, 30, 2)])
    running = one.claim("w1", 60)
    assert running is not None
    assert two.set_status("b3", "cancelling", "", ("in_progress",))
    assert two.claim("w2", 60) is None
    assert one.to_finish() == []  # its one chunk is still running
    assert one.commit_chunk("b3", running.seq, "w1", "r", 1, 0)
    assert [b["id"] for b in one.to_finish()] == ["b3"]


def test_owners_see_only_their_own_and_old_rows_expire(stores: tuple[Store, Store]) -> None:
    one, _ = stores
    _file(one, "alice", "file-a")
    _file(one, "bob", "file-y")
    one.add_batch({**_batch("mine", owner="alice", status="completed"), "input_file_id": "file-a"}, [])
    one.add_batch({**_batch("theirs", owner="bob"), "input_file_id": "file-y"}, [])
    assert one.batch("mine", "bob") is None and one.batch("mine", "alice") is not None
    assert [b["id"] for b in one.batches("bob", None, 10)[0]] == ["theirs"]
    with pytest.raises(UnknownCursor):  # a cursor of another's id names nothing of bob's
        one.batches("bob", "mine", 10)
    files, batches = one.old(time.time() + 1)
    assert batches == ["mine"]  # only a finished one
    one.forget(files, batches)
    assert one.batch("mine", "alice") is None and one.batch("theirs", "bob") is not None


def test_a_batch_past_its_window_gives_no_chunk_and_a_late_commit_counts_nothing(stores: tuple[Store, Store]) -> None:
    one, two = stores
    one.add_batch(_batch("b4"), [(0, 10, 0), (10, 20, 1)])
    running = one.claim("w1", 60)
    assert running is not None
    with one.engine.begin() as conn:  # its window ends while the chunk runs
        conn.exec_driver_sql("UPDATE inferd_batches SET expires_at = 1 WHERE id = 'b4'")
    assert two.claim("w2", 60) is None
    assert one.to_finish() == []  # its running chunk first
    one.release_chunk("b4", running.seq, "w1")
    assert [b["id"] for b in one.to_finish()] == ["b4"] and one.undone("b4") == [(0, 10, 0), (10, 20, 1)]
    again = one.claim("w1", 60)
    assert again is None
    assert one.finish("b4", "expired", None, None, [], unrun=3)
    late = one.batch("b4", None)
    assert (late["status"], late["completed"], late["failed"]) == ("expired", 0, 3)


def test_a_commit_after_the_batch_ended_changes_nothing(stores: tuple[Store, Store]) -> None:
    one, two = stores
    one.add_batch(_batch("b5"), [(0, 10, 0)])
    running = one.claim("w1", 60)
    assert running is not None and two.set_status("b5", "cancelling", "", ("in_progress",))
    with one.engine.begin() as conn:  # its lease ran out, and the batch was finished without it
        conn.exec_driver_sql("UPDATE inferd_chunks SET lease_until = 1 WHERE batch_id = 'b5'")
    assert two.finish("b5", "cancelled", None, None, [], unrun=1)
    assert not one.commit_chunk("b5", running.seq, "w1", "late", 1, 0)
    assert one.batch("b5", None)["completed"] == 0 and one.results("b5") == []


def test_a_file_a_running_batch_reads_is_kept_and_a_deleted_one_makes_no_batch(stores: tuple[Store, Store]) -> None:
    one, two = stores
    one.add_batch(_batch("b6"), [(0, 10, 0)])
    assert two.delete_file("file-x", "") == "in_use"
    assert two.delete_file("file-x", "mallory") == "missing"  # another owner's: as if it did not exist
    assert two.set_status("b6", "cancelled", "", ("in_progress",))
    assert two.delete_file("file-x", "") == "deleted" and two.delete_file("file-x", "") == "missing"
    with pytest.raises(FileGone):
        one.add_batch(_batch("b7"), [(0, 10, 0)])
    assert one.batch("b7", None) is None and one.undone("b7") == []


def test_a_schema_1_store_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    old = Store.at(tmp_path, None)
    _file(old)
    old.add_batch(_batch("kept"), [(0, 10, 0)])
    with old.engine.begin() as conn:  # the store as version 1 made it: no errors column
        conn.exec_driver_sql("ALTER TABLE inferd_batches DROP COLUMN errors")
        conn.exec_driver_sql("UPDATE inferd_jobs_meta SET value = 1 WHERE key = 'schema'")
    old.close()
    store = Store.at(tmp_path, None)
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT value FROM inferd_jobs_meta").scalar() == SCHEMA_VERSION == 2
        assert store.batch("kept", "")["errors"] is None
        errors = [{"code": "tenant_removed", "message": "gone", "param": None, "line": None}]
        assert store.set_status("kept", "cancelling", "", ("in_progress",), errors=errors)
        assert store.batch("kept", "")["errors"] in (errors, __import__("json").dumps(errors))
    finally:
        store.close()
