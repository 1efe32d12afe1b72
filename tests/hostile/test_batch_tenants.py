"""Batch jobs between tenants (issue 42): a tenant cannot read, cancel or list another's files or jobs (each is a
404, as a file that does not exist, and a list holds only its own); a job's lines run as its owner and are counted
against the owner's usage; bad files (not JSONL, a line over the limit, no line, an unknown endpoint, bodies that
fail validation) get a clear error and touch no other job.

And a job's lines run below online requests: queued behind a held worker, they let an online request that came
after them run first. A job's lines do not take their owner's concurrency or request rate from its online requests;
a tenant removed by a SIGHUP has its running job stopped (cancelled, with the reason in its ``errors`` and an error
record for every line it never ran), not run as no one past its limits; a job past its window ends expired with
a record for every line too.

One real server of the fake HashHandler (no model weights) with two tenants, ``alice`` and ``bob``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from batchkit import create, embedding_lines, jsonl, line, records, upload, wait_final
from conftest import Server, metric_value, wait_for

from hostile.conftest import internal_errors
from inferd.jobs.store import Store

KEYS = {"alice": "alice-secret-key-0001", "bob": "bob-secret-key-0002"}
ADMIN = "admin-secret-key-0003"
MAX_LINE = 2048


def _tenants_server(module_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory,
                    **extra: str) -> Server:
    tmp = tmp_path_factory.mktemp("batch-tenants")
    tenants = tmp / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{"name": name, "keys": [key]} for name, key in KEYS.items()]}))
    return module_server(INFERD__SERVER__TENANTS_FILE=str(tenants), INFERD__SERVER__ADMIN_KEY=ADMIN,
                         FAKE_RECORD=str(tmp / "batches.jsonl"),
                         INFERD__JOBS__MAX_LINE_BYTES=str(MAX_LINE), INFERD__JOBS__CHUNK_SIZE="100",
                         INFERD__BATCHING__MAX_BATCH_SIZE="32", **extra)


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    return _tenants_server(module_server, tmp_path_factory)


@pytest.fixture(scope="module")
def one_queue_server(module_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    """A job's lines on the model's instance, between live batches (no background worker)."""
    return _tenants_server(module_server, tmp_path_factory, INFERD__BATCHING__BACKGROUND_PAUSES="false")


def client(server: Server, tenant: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def usage(server: Server, tenant: str) -> int:
    answer = httpx.get(server.url + "/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    return sum(m["requests"] for m in answer.json()["tenants"][tenant]["models"].values())


def test_a_tenant_cannot_read_cancel_or_list_another_s_files_or_jobs(server: Server) -> None:
    with client(server, "alice") as alice, client(server, "bob") as bob:
        file_id = upload(alice, jsonl(embedding_lines(20, "a"))).json()["id"]
        batch_id = create(alice, file_id).json()["id"]
        for method, path in [("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
                             ("DELETE", f"/v1/files/{file_id}"), ("GET", f"/v1/batches/{batch_id}"),
                             ("POST", f"/v1/batches/{batch_id}/cancel")]:
            answer = bob.request(method, path)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] in ("file_not_found", "batch_not_found")
        stolen = create(bob, file_id)  # a batch of alice's file, as bob
        assert stolen.status_code == 404 and stolen.json()["error"]["code"] == "file_not_found"
        assert file_id not in [f["id"] for f in bob.get("/v1/files").json()["data"]]
        assert batch_id not in [b["id"] for b in bob.get("/v1/batches").json()["data"]]
        # Paging from another tenant's id leaks nothing either: as an id that names nothing.
        for after in (batch_id, "batch_none"):
            paged = bob.get("/v1/batches", params={"after": after})
            assert paged.status_code == 400 and paged.json()["error"]["message"] == (
                f"after {after!r} names no object of yours (deleted since the last page?)")
        assert httpx.get(server.url + "/v1/files", timeout=10).status_code == 401  # and no key, no files
        batch = wait_final(alice, batch_id)
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 20
        assert bob.get(f"/v1/files/{batch['output_file_id']}/content").status_code == 404
        assert len(records(alice, batch["output_file_id"])) == 20
        assert alice.get(f"/v1/files/{file_id}").status_code == 200
        assert batch_id in [b["id"] for b in alice.get("/v1/batches").json()["data"]]


def test_a_job_s_lines_run_as_its_owner(server: Server) -> None:
    before = {name: usage(server, name) for name in KEYS}
    with client(server, "alice") as alice:
        file_id = upload(alice, jsonl(embedding_lines(150, "u"))).json()["id"]
        batch = wait_final(alice, create(alice, file_id).json()["id"])
    assert batch["request_counts"]["completed"] == 150
    assert usage(server, "alice") - before["alice"] == 150 and usage(server, "bob") == before["bob"]


def test_bad_files_get_a_clear_error_and_touch_no_other_job(server: Server) -> None:
    errors_before = internal_errors(server)
    with client(server, "alice") as alice, client(server, "bob") as bob:
        good = create(alice, upload(alice, jsonl(embedding_lines(2000, "n"))).json()["id"]).json()["id"]
        for data, code in [(b"<html>not a batch</html>\n", "invalid_file"), (b"", "empty_file"),
                           (jsonl([line("x", {"input": "y" * MAX_LINE})]), "line_too_large"),
                           (b"\x00\xff" * 100, "invalid_file")]:
            refused = upload(bob, data)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == code, refused.text
        valid = upload(bob, jsonl(embedding_lines(5, "b"))).json()["id"]
        unknown = create(bob, valid, "/v1/completions")
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_endpoint"
        # Every line's body fails validation: the batch runs, and each line is an error, none an answer.
        invalid = upload(bob, jsonl([line(f"v{i}", {"input": "ok", "dimensions": "many"}) for i in range(5)]))
        failed = wait_final(bob, create(bob, invalid.json()["id"]).json()["id"])
        assert failed["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
        assert failed["output_file_id"] is None
        assert all(r["error"]["code"] == "invalid_value" for r in records(bob, failed["error_file_id"]))
        batch = wait_final(alice, good)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 2000, "completed": 2000,
                                                                           "failed": 0}
    assert internal_errors(server) == errors_before


def test_a_job_runs_on_the_background_worker_while_an_online_request_holds_the_model(server: Server) -> None:
    """The model's live instance held by an online request: the job's lines do not queue behind it, they run on
    the model's background worker, and the job completes while the online request is still held."""
    gate = Path(server.env["FAKE_GATE_DIR"]) / "job-beside"
    with client(server, "alice") as alice:
        answered: list[int] = []
        holder = threading.Thread(target=lambda: answered.append(
            alice.post("/predict", json={"texts": ["hold:job-beside x"]}).status_code))
        holder.start()
        try:
            wait_for(lambda: any("hold:job-beside x" in r for r in _ran(Path(server.env["FAKE_RECORD"]))), 30,
                     "the live instance held")
            file_id = upload(alice, jsonl(embedding_lines(40, "b"))).json()["id"]
            batch_id = create(alice, file_id).json()["id"]
            assert wait_final(alice, batch_id)["request_counts"]["completed"] == 40
            assert holder.is_alive() and not answered  # the job finished beside the held online request
        finally:
            gate.touch()
            holder.join(60)
        assert answered == [200]


def test_online_requests_run_before_a_job_s_queued_lines(one_queue_server: Server) -> None:
    """With one queue (``batching.background_pauses: false``), the worker held by an online request; a job's lines
    queue behind it, then one more online request: when the worker is free, the online request runs first (the
    lines wait at the lowest priority)."""
    server = one_queue_server
    record = Path(server.env["FAKE_RECORD"])
    gate = Path(server.env["FAKE_GATE_DIR"]) / "batch-priority"
    with client(server, "alice") as alice:
        holder = threading.Thread(target=lambda: alice.post("/predict", json={"texts": ["hold:batch-priority x"]}))
        holder.start()
        try:
            wait_for(lambda: any("hold:batch-priority x" in r for r in _ran(record)), 30, "the worker held")
            file_id = upload(alice, jsonl(embedding_lines(40, "q"))).json()["id"]
            batch_id = create(alice, file_id).json()["id"]
            wait_for(lambda: metric_value(httpx.get(server.url + "/metrics").text, "inferd_queue_depth") >= 40, 30,
                     "the job's lines queued")
            online = threading.Thread(target=lambda: alice.post("/predict", json={"texts": ["online after the job"]}))
            online.start()
            wait_for(lambda: metric_value(httpx.get(server.url + "/metrics").text, "inferd_queue_depth") >= 41, 30,
                     "the online request queued")
        finally:
            gate.touch()
            holder.join(60)
        online.join(60)
        assert wait_final(alice, batch_id)["request_counts"]["completed"] == 40
    ran = _ran(record)
    held = next(i for i, texts in enumerate(ran) if "hold:batch-priority x" in texts)
    after = ran[held + 1:]
    first_online = next(i for i, texts in enumerate(after) if "online after the job" in texts)
    first_line = next(i for i, texts in enumerate(after) if any(t.startswith("text number") for t in texts))
    assert first_online <= first_line and after[first_online][0] == "online after the job", after[:3]


def _ran(record: Path) -> list[list[str]]:
    """The fake's batches, in the order they ran (FAKE_RECORD)."""
    if not record.exists():
        return []
    return [json.loads(raw)["texts"] for raw in record.read_text().splitlines() if raw.strip()]


LIMITED = {"dave": "dave-secret-key-0004", "carol": "carol-secret-key-0005"}


def _limited_tenants(with_carol: bool = True) -> dict:
    rules = [{"name": "dave", "keys": [LIMITED["dave"]], "max_concurrent": 2, "requests_per_second": 3}]
    if with_carol:
        rules.append({"name": "carol", "keys": [LIMITED["carol"]]})
    return {"tenants": rules}


@pytest.fixture(scope="module")
def limited_server(module_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("batch-limits")
    (tmp / "tenants.yaml").write_text(yaml.safe_dump(_limited_tenants()))
    return module_server(INFERD__SERVER__TENANTS_FILE=str(tmp / "tenants.yaml"), FAKE_RECORD=str(tmp / "ran.jsonl"),
                         INFERD__JOBS__DATA_DIR=str(tmp / "jobs"), INFERD__JOBS__CHUNK_SIZE="20",
                         INFERD__BATCHING__MAX_BATCH_SIZE="8")


def _held_job(server: Server, who: str, gate: str, lines: int) -> str:
    """A job of ``who``'s whose first line holds the model's background worker until ``gate`` is touched."""
    held = [line(f"{gate}-hold", {"input": f"hold:{gate} x"}), *embedding_lines(lines - 1, gate)]
    with server.client(headers={"Authorization": f"Bearer {LIMITED[who]}"}) as c:
        batch_id = create(c, upload(c, jsonl(held)).json()["id"]).json()["id"]
    wait_for(lambda: any(f"hold:{gate} x" in r for r in _ran(Path(server.env["FAKE_RECORD"]))), 30,
             f"{who}'s job holding the background worker")
    return batch_id


def test_a_job_takes_neither_its_owner_s_concurrency_nor_its_request_rate(limited_server: Server) -> None:
    """dave may have 2 requests running and send 3 a second; his job's lines (held: up to jobs.lines_in_flight of
    them admitted and queued) are none of those, so his online requests, at 2 a second, are all answered."""
    server = limited_server
    gate = Path(server.env["FAKE_GATE_DIR"]) / "dave-job"
    try:
        batch_id = _held_job(server, "dave", "dave-job", 60)
        with server.client(headers={"Authorization": f"Bearer {LIMITED['dave']}"}) as dave:
            answers = []
            for i in range(6):
                answers.append(dave.post("/v1/embeddings", json={"input": f"online {i}"}))
                time.sleep(0.5)
            assert dave.get(f"/v1/batches/{batch_id}").json()["status"] == "in_progress"  # held all along
            assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers if a.status_code != 200]
            gate.touch()
            batch = wait_final(dave, batch_id)
    finally:
        gate.touch()
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 60


def test_a_removed_tenant_s_job_stops_with_its_reason_and_a_record_for_every_line(limited_server: Server,
                                                                                   tmp_path: Path) -> None:
    server = limited_server
    tenants_file = Path(server.env["INFERD__SERVER__TENANTS_FILE"])
    gate = Path(server.env["FAKE_GATE_DIR"]) / "carol-job"
    store = Store.at(Path(server.env["INFERD__JOBS__DATA_DIR"]), None)
    try:
        batch_id = _held_job(server, "carol", "carol-job", 100)
        tenants_file.write_text(yaml.safe_dump(_limited_tenants(with_carol=False)))
        mark = len(server.log())
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: tenants" in server.log()[mark:], 30, "the SIGHUP's tenants")
        gate.touch()  # the chunk running goes on to its end; no other chunk of carol's runs
        stopped = wait_for(lambda: (b := store.batch(batch_id, None)) and b["status"] == "cancelled" and b, 60,
                           "carol's job stopped")
    finally:
        gate.touch()
        tenants_file.write_text(yaml.safe_dump(_limited_tenants()))
        mark = len(server.log())
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: tenants" in server.log()[mark:], 30, "carol back")
        store.close()
    assert stopped["completed"] < 100 and stopped["completed"] + stopped["failed"] == 100
    with server.client(headers={"Authorization": f"Bearer {LIMITED['carol']}"}) as carol:
        batch = carol.get(f"/v1/batches/{batch_id}").json()
        assert batch["errors"]["data"][0]["code"] == "tenant_removed", batch
        out, errors = records(carol, batch["output_file_id"]), records(carol, batch["error_file_id"])
    assert sorted(r["custom_id"] for r in out + errors) == sorted(["carol-job-hold", *(f"carol-job{i}"
                                                                                        for i in range(99))])
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"} and len(errors) == stopped["failed"]


def test_a_job_past_its_window_ends_expired_with_a_record_for_every_line(limited_server: Server) -> None:
    """Its window passes while a chunk runs: that chunk ends and counts, no other starts, and the lines never run
    are each an error record (batch_expired, OpenAI's code), so the files hold every line once."""
    server = limited_server
    gate = Path(server.env["FAKE_GATE_DIR"]) / "late-job"
    store = Store.at(Path(server.env["INFERD__JOBS__DATA_DIR"]), None)
    try:
        batch_id = _held_job(server, "dave", "late-job", 100)
        with store.engine.begin() as conn:  # the 24 h window, over
            conn.exec_driver_sql(f"UPDATE inferd_batches SET expires_at = 1 WHERE id = '{batch_id}'")
        gate.touch()
        with server.client(headers={"Authorization": f"Bearer {LIMITED['dave']}"}) as dave:
            batch = wait_final(dave, batch_id)
            out, errors = records(dave, batch["output_file_id"]), records(dave, batch["error_file_id"])
    finally:
        gate.touch()
        store.close()
    counts = batch["request_counts"]
    assert batch["status"] == "expired" and batch["expired_at"] is not None, batch
    assert counts["completed"] == len(out) >= 1 and counts["completed"] + counts["failed"] == 100 == len(out + errors)
    expected = ["late-job-hold", *(f"late-job{i}" for i in range(99))]
    assert sorted(r["custom_id"] for r in out + errors) == sorted(expected)
    assert {r["error"]["code"] for r in errors} == {"batch_expired"}
