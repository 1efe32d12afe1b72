"""The job store's guarantees, on SQLite files shared by two Store objects (two processes' view of one store):
a chunk is one worker's at a time; a commit by a worker that lost its lease changes nothing; a dead worker's chunk
is taken again once its lease runs out; a batch is finished once; owners see only their own; old rows expire.
No server: jobs/store.py alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.jobs.store import Store


def _batch(batch_id: str, owner: str = "", status: str = "in_progress", total: int = 3) -> dict:
    now = time.time()
    return {"id": batch_id, "owner": owner, "endpoint": "/v1/embeddings", "input_file_id": "file-x",
            "completion_window": "24h", "status": status, "created_at": now, "in_progress_at": now,
            "expires_at": now + 86400, "total": total, "completed": 0, "failed": 0, "metadata": None,
            "duplicates": []}


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    one, two = Store.at(tmp_path, None), Store.at(tmp_path, None)
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
    assert one.finish("b2", "completed", None, None) and not two.finish("b2", "completed", None, None)
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
    one.add_batch(_batch("mine", owner="alice", status="completed"), [])
    one.add_batch(_batch("theirs", owner="bob"), [])
    assert one.batch("mine", "bob") is None and one.batch("mine", "alice") is not None
    assert [b["id"] for b in one.batches("bob", None, 10)[0]] == ["theirs"]
    assert one.batches("bob", "mine", 10) == ([], False)  # a cursor of another's id finds nothing
    files, batches = one.old(time.time() + 1)
    assert batches == ["mine"]  # only a finished one
    one.forget(files, batches)
    assert one.batch("mine", "alice") is None and one.batch("theirs", "bob") is not None
