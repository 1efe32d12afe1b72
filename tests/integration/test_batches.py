"""OpenAI's Files and Batches API against a real server of a tiny BERT (issue 42): the openai SDK end to end on
10,000 lines, each vector the online route's; bad lines reported and the rest run; the other endpoints' bodies
equal to their online answers; cancel within a chunk; the files' routes and refusals; paging; the job metrics.

One server for the module (jobs on, as configs/base.yaml has them; SQLite under the server's working folder).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from batchkit import create, embedding_lines, jsonl, line, records, upload, wait_final
from conftest import Server, metric_value
from tinymodel import write_tiny_bert

CHUNK = 256
MAX_LINE = 4096
MAX_FILE = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module_serve: Callable[..., Server]) -> Server:
    model = write_tiny_bert(tmp_path_factory.mktemp("batch-model") / "bert", seed=11)
    return module_serve({"INFERD__MODEL__PATH": str(model), "INFERD__MODEL__LOAD_MODE": "eager",
                         "INFERD__CACHE__MAX_ENTRIES": "0", "INFERD__SERVER__ACCESS_LOG": "false",
                         "INFERD__JOBS__CHUNK_SIZE": str(CHUNK), "INFERD__JOBS__MAX_LINE_BYTES": str(MAX_LINE),
                         "INFERD__JOBS__MAX_FILE_BYTES": str(MAX_FILE)},
                        wait="/health/ready")


def _online(server: Server, texts: list[str]) -> np.ndarray:
    """/v1/embeddings' vectors for ``texts``, 256 a request."""
    rows: list[list[float]] = []
    with server.client() as client:
        for i in range(0, len(texts), 256):
            answer = client.post("/v1/embeddings", json={"input": texts[i:i + 256]})
            assert answer.status_code == 200, answer.text
            rows += [d["embedding"] for d in answer.json()["data"]]
    return np.asarray(rows, dtype=np.float64)


def test_the_openai_sdk_runs_10000_lines_each_as_the_online_route_answers_it(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    lines = embedding_lines(10_000)
    sent = client.files.create(file=("corpus.jsonl", jsonl(lines)), purpose="batch")
    assert sent.purpose == "batch" and sent.bytes == len(jsonl(lines))
    batch = client.batches.create(input_file_id=sent.id, endpoint="/v1/embeddings", completion_window="24h")
    assert batch.status == "in_progress" and batch.request_counts is not None and batch.request_counts.total == 10_000
    with server.client() as http:
        wait_final(http, batch.id)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (10_000, 0)
    assert batch.error_file_id is None and batch.output_file_id is not None
    out = [json.loads(raw) for raw in client.files.content(batch.output_file_id).text.splitlines()]
    ids = [r["custom_id"] for r in out]
    assert len(ids) == 10_000 and set(ids) == {f"t{i}" for i in range(10_000)}  # every line exactly once
    texts = [json.loads(raw)["body"]["input"] for raw in lines]
    online = _online(server, texts)
    got = np.zeros_like(online)
    for record in out:
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        got[int(record["custom_id"][1:])] = body["data"][0]["embedding"]
    cos = (got * online).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(online, axis=1)
    assert cos.min() >= 0.99999, cos.min()


def test_three_bad_lines_among_many_are_reported_and_the_rest_run(server: Server) -> None:
    lines = embedding_lines(600, "g")
    lines[10] = line("g10", {"input": "fine", "encoding_format": "hex"})  # fails the route's schema
    lines[300] = "{not json"
    lines[599] = line("g599", {"input": ""})  # passes the schema; the route refuses an empty text (422)
    with server.client() as client:
        file_id = upload(client, jsonl(lines)).json()["id"]
        batch = wait_final(client, create(client, file_id).json()["id"])
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 600, "completed": 597, "failed": 3}
        ok, bad = records(client, batch["output_file_id"]), records(client, batch["error_file_id"])
    assert len(ok) == 597 and {r["custom_id"] for r in ok} == {f"g{i}" for i in range(600)} - {"g10", "g300", "g599"}
    by_id = {r["custom_id"]: r for r in bad}
    assert set(by_id) == {"g10", None, "g599"}
    assert by_id["g10"]["response"] is None and "line 11" in by_id["g10"]["error"]["message"]
    assert "encoding_format" in by_id["g10"]["error"]["message"]
    assert by_id[None]["error"]["code"] == "invalid_json" and "line 301" in by_id[None]["error"]["message"]
    refused = by_id["g599"]["response"]
    assert refused["status_code"] == 422 and refused["body"]["error"]["param"] == "input"


def test_an_encode_batch_answers_as_the_online_route(server: Server) -> None:
    bodies = [{"input": [f"first {i}", f"second {i}"], "outputs": ["dense"]} for i in range(20)]
    with server.client() as client:
        file_id = upload(client, jsonl([line(f"e{i}", b, "/v1/encode") for i, b in enumerate(bodies)])).json()["id"]
        batch = wait_final(client, create(client, file_id, "/v1/encode").json()["id"])
        assert batch["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
        for record in records(client, batch["output_file_id"]):
            online = client.post("/v1/encode", json=bodies[int(record["custom_id"][1:])]).json()
            got = record["response"]["body"]
            assert got["model"] == online["model"] and got["usage"] == online["usage"]
            np.testing.assert_allclose([d["dense"] for d in got["data"]], [d["dense"] for d in online["data"]],
                                       rtol=1e-5, atol=1e-6)


def test_cancel_stops_within_a_chunk_and_keeps_what_was_done(server: Server) -> None:
    with server.client() as client:
        file_id = upload(client, jsonl(embedding_lines(6000, "x"))).json()["id"]
        batch_id = create(client, file_id).json()["id"]
        cancelled = client.post(f"/v1/batches/{batch_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
        batch = wait_final(client, batch_id)
        assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
        counts = batch["request_counts"]
        # The chunks running when the cancel came finish (jobs.concurrency 2 of them, and as many claimed at
        # that moment); no other starts. Every line it never ran has an error record of its own.
        assert counts["completed"] <= 4 * CHUNK and counts["completed"] + counts["failed"] == 6000, batch
        out = records(client, batch["output_file_id"]) if counts["completed"] else []
        errors = records(client, batch["error_file_id"])
        assert len(out) == counts["completed"] and len(errors) == counts["failed"]
        assert sorted(r["custom_id"] for r in out + errors) == sorted(f"x{i}" for i in range(6000))
        assert {r["error"]["code"] for r in errors} == {"batch_cancelled"}
        assert all(r["response"] is None for r in errors)
        again = client.post(f"/v1/batches/{batch_id}/cancel")
        assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_a_file_deleted_while_a_batch_is_made_of_it_leaves_no_batch_without_its_input(server: Server) -> None:
    """A DELETE of a file and a batch made of it, sent at once: the delete is refused (the batch reads it) or the
    batch is (the file is gone), never both answered, which left a batch that could never run (its chunks failed
    and were retried for ever, ahead of every newer job)."""
    data = jsonl(embedding_lines(300, "r"))
    made = []
    with server.client() as client, ThreadPoolExecutor(2) as pool:
        for _ in range(8):
            file_id = upload(client, data).json()["id"]
            creating = pool.submit(create, client, file_id)
            deleting = pool.submit(client.delete, f"/v1/files/{file_id}")
            batch, gone = creating.result(), deleting.result()
            assert (batch.status_code, gone.status_code) in ((200, 409), (404, 200)), (batch.text, gone.text)
            if batch.status_code == 200:
                made.append(batch.json()["id"])
            else:
                assert batch.json()["error"]["code"] == "file_not_found"
                assert client.get(f"/v1/files/{file_id}").status_code == 404
        for batch_id in made:
            assert wait_final(client, batch_id)["request_counts"]["completed"] == 300


@pytest.mark.parametrize(("data", "code"), [
    (b"a,b,c\n1,2,3\n", "invalid_file"),  # not JSONL
    (b"", "empty_file"),
    (b"\n\n", "empty_file"),
    (b"\xff\xfe{}\n", "invalid_file"),  # not UTF-8
    (jsonl([line("long", {"input": "w " * MAX_LINE})]), "line_too_large"),
])
def test_a_bad_file_is_refused_whole(server: Server, data: bytes, code: str) -> None:
    with server.client() as client:
        refused = upload(client, data)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == code and refused.json()["error"]["param"] == "file"


def test_the_files_routes(server: Server, tmp_path: Path) -> None:
    data = jsonl(embedding_lines(3, "f"))
    with server.client() as client:
        assert upload(client, data, purpose="fine-tune").json()["error"]["code"] == "invalid_purpose"
        not_form = client.post("/v1/files", content=data, headers={"content-type": "application/jsonl"})
        assert not_form.status_code == 400 and not_form.json()["error"]["code"] == "invalid_multipart"
        sent = upload(client, data, name="three.jsonl").json()
        assert (sent["object"], sent["filename"], sent["bytes"], sent["status"]) == ("file", "three.jsonl", len(data),
                                                                                   "processed")
        assert client.get(f"/v1/files/{sent['id']}").json() == sent
        assert client.get(f"/v1/files/{sent['id']}/content").content == data
        assert sent["id"] in [f["id"] for f in client.get("/v1/files", params={"purpose": "batch"}).json()["data"]]
        for refused, status, code in [
                (create(client, sent["id"], "/v1/chat/completions"), 400, "unknown_endpoint"),
                (create(client, "file-doesnotexist"), 404, "file_not_found"),
                (client.post("/v1/batches", json={"input_file_id": sent["id"], "endpoint": "/v1/embeddings",
                                                  "completion_window": "soon"}), 400, "invalid_value"),
                (client.post("/v1/batches", json={"input_file_id": sent["id"]}), 422, "invalid_value")]:
            assert refused.status_code == status and refused.json()["error"]["code"] == code, refused.text
        assert client.delete(f"/v1/files/{sent['id']}").json() == {"id": sent["id"], "object": "file", "deleted": True}
        assert client.get(f"/v1/files/{sent['id']}").status_code == 404
        assert client.get(f"/v1/files/{sent['id']}/content").status_code == 404


def test_the_files_options_the_openai_client_sends(server: Server) -> None:
    """expires_after, order and filenames as the openai client sends them; a cursor that names nothing; a file over
    jobs.max_file_bytes refused by that setting's name; metadata within OpenAI's bounds."""
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    data = jsonl(embedding_lines(2, "o"))
    kept = sdk.files.create(file=("a\"b.jsonl", data), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert kept.filename == 'a"b.jsonl' and kept.expires_at - kept.created_at == 3600
    made = [kept.id, *(sdk.files.create(file=(f"{i}.jsonl", data), purpose="batch").id for i in range(2))]
    oldest_first = [f.id for f in sdk.files.list(order="asc", limit=100) if f.id in made]
    assert oldest_first == made
    page = sdk.files.list(order="asc", limit=1, after=made[0])
    assert [f.id for f in page.data] == [made[1]]
    with server.client() as client:
        bad_window = upload_with(client, data, {"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"})
        assert bad_window.status_code == 400 and bad_window.json()["error"]["param"] == "expires_after.seconds"
        unnamed = client.post("/v1/files", files={"file": (None, data, "application/jsonl")},
                              data={"purpose": "batch"})
        assert unnamed.status_code == 200 and unnamed.json()["filename"] == "file", unnamed.text
        too_big = upload(client, b"{}\n" * (MAX_FILE // 3 + 1))
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "file_too_large", too_big.text
        assert "jobs.max_file_bytes" in too_big.json()["error"]["message"]
        client.delete(f"/v1/files/{made[0]}")
        lost = client.get("/v1/files", params={"after": made[0]})  # a client paging past a deleted file
        assert lost.status_code == 400 and lost.json()["error"]["code"] == "invalid_cursor", lost.text
        assert client.get("/v1/batches", params={"after": "batch_none"}).json()["error"]["code"] == "invalid_cursor"
        for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
            refused = client.post("/v1/batches", json={"input_file_id": made[1], "endpoint": "/v1/embeddings",
                                                       "completion_window": "24h", "metadata": metadata})
            assert refused.status_code == 422 and refused.json()["error"]["param"].startswith("metadata"), refused.text


def upload_with(client: httpx.Client, data: bytes, fields: dict[str, str]) -> httpx.Response:
    return client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch", **fields})


def test_batches_are_listed_newest_first_in_pages(server: Server) -> None:
    with server.client() as client:
        file_id = upload(client, jsonl(embedding_lines(2, "p"))).json()["id"]
        made = [create(client, file_id).json()["id"] for _ in range(3)]
        first = client.get("/v1/batches", params={"limit": 2}).json()
        assert [b["id"] for b in first["data"]] == made[::-1][:2] and first["has_more"] is True
        rest = client.get("/v1/batches", params={"limit": 2, "after": first["last_id"]}).json()
        assert rest["data"][0]["id"] == made[0]
        for batch_id in made:
            wait_final(client, batch_id)


def test_the_job_metrics_count_lines_and_jobs(server: Server) -> None:
    with server.client() as client:
        before = metric_value(client.get("/metrics").text, "inferd_job_lines_total", outcome="ok")
        file_id = upload(client, jsonl(embedding_lines(50, "m"))).json()["id"]
        wait_final(client, create(client, file_id).json()["id"])
        text = client.get("/metrics").text
    assert metric_value(text, "inferd_job_lines_total", outcome="ok") == before + 50
    assert "inferd_job_lines_per_second" in text and "inferd_job_backlog_lines" in text


@pytest.mark.parametrize(("fixture", "endpoint", "make"), [
    ("reranker", "/v1/rerank", lambda i: {"query": f"query {i}", "documents": [f"doc {i}", f"other {i}", "third"]}),
    ("classifier", "/v1/classify", lambda i: {"input": [f"a text {i}", f"another {i}"]}),
])
def test_rerank_and_classify_batches_answer_as_their_online_routes(request: pytest.FixtureRequest, fixture: str,
                                                                   endpoint: str,
                                                                   make: Callable[[int], dict]) -> None:
    task_server: Server = request.getfixturevalue(fixture)  # the package's reranker and classifier servers
    bodies = [make(i) for i in range(12)]
    with task_server.client() as client:
        file_id = upload(client, jsonl([line(f"r{i}", b, endpoint) for i, b in enumerate(bodies)])).json()["id"]
        batch = wait_final(client, create(client, file_id, endpoint).json()["id"])
        assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}, batch
        for record in records(client, batch["output_file_id"]):
            online = client.post(endpoint, json=bodies[int(record["custom_id"][1:])]).json()
            got = record["response"]["body"]
            assert got.keys() == online.keys()
            # Everything but the id a route gives each answer (its request's) is the online answer's, the scores
            # and probabilities to float32's rounding (the batches that computed them were made up differently).
            _same({k: v for k, v in got.items() if k != "id"}, {k: v for k, v in online.items() if k != "id"})


def _same(got: object, want: object) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (got, want)
        for key in want:
            _same(got[key], want[key])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for a, b in zip(got, want, strict=True):
            _same(a, b)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    else:
        assert got == want
