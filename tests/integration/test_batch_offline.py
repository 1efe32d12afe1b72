"""``inferd batch`` (issue 42 item 6) against a real server's batch job on the same file (tiny model):

- a real ``inferd batch`` process killed with SIGKILL mid-run, its output then torn as a crash mid-write leaves
  it, and the same command run again: every line's record once, in input order, each equal to the record the
  server's batch job wrote for that line (the job followed with ``inferd jobs show --follow``, the openai SDK
  uploading and downloading its files);
- Parquet in and out, in-process, stopped between a chunk's part file and its checkpoint and run again: the
  same records as the JSONL run's;
- the refusals of a file, an endpoint or an output it cannot use, before any model loads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import openai
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, Server, wait_for
from settingskit import make_settings
from tinymodel import WORDS, write_tiny_bert

from inferd import cli
from inferd.jobs import checkpoint, offline
from inferd.jobs.lines import FileRefused
from inferd.jobs.tables import BadFile, read_records

KEY = "batch-key"
LINES = 300
# Lines that never run: not JSON, a custom_id an earlier line has, a body the route refuses.
BROKEN = {100: b"{not json", 200: b'{"custom_id": "c5", "method": "POST", "url": "/v1/embeddings", '
                                  b'"body": {"input": "again"}}',
          250: b'{"custom_id": "c250", "method": "POST", "url": "/v1/embeddings", "body": {"inptu": "x"}}'}


def corpus() -> list[bytes]:
    rng = random.Random(42)
    lines = []
    for n in range(LINES):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        lines.append(BROKEN.get(n) or orjson.dumps({"custom_id": f"c{n}", "method": "POST",
                                                    "url": "/v1/embeddings", "body": {"input": text}}))
    lines.insert(150, b"")  # a blank line: no request, no record
    return lines


@pytest.fixture(scope="module")
def input_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("in") / "corpus.jsonl"
    path.write_bytes(b"\n".join(corpus()) + b"\n")
    return path


@pytest.fixture(scope="module")
def server(module_serve: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    return module_serve({"INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__LOAD_MODE": "eager",
                         "INFERD__SERVER__API_KEYS": KEY, "INFERD__CACHE__MAX_ENTRIES": "0",
                         "INFERD__JOBS__DATA_DIR": str(tmp_path_factory.mktemp("jobs")),
                         "INFERD__JOBS__CHUNK_SIZE": "64"}, wait=None)  # ready by server_records


@pytest.fixture(scope="module")
def server_records(server: Server, input_file: Path) -> dict[str, Any]:
    """The server's batch job on the corpus: its output and error files' records, by custom_id (None for the line
    that has none, "duplicate" for the line repeating one), uploaded and downloaded with the openai SDK, followed
    to the end with ``inferd jobs``; and the job's id ("batch_id")."""
    server.wait_ready(120, "/health/ready")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=30)
    uploaded = client.files.create(file=input_file.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert cli.main(["jobs", "show", batch.id, "--follow", "--interval", "0.1", "--url", server.url,
                     "--key", KEY]) == 0
    done = client.batches.retrieve(batch.id)
    records = [json.loads(line) for file_id in (done.output_file_id, done.error_file_id) if file_id
               for line in client.files.content(file_id).text.splitlines()]
    assert len(records) == LINES
    return {r["custom_id"]: r for r in records if (r["error"] or {}).get("code") != "duplicate_custom_id"} | {
        "duplicate": next(r for r in records if (r["error"] or {}).get("code") == "duplicate_custom_id"),
        "batch_id": batch.id}


def batch_command(tiny_model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "inferd.cli", "batch", *args, "--model-path", str(tiny_model), "--torch-threads",
            "1", "--no-progress"]


def batch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERD")}
    return {**env, "INFERD_CONFIG_DIR": str(ROOT / "configs"), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def assert_same(offline_records: list[dict[str, Any]], server_records: dict[str, Any]) -> None:
    """Each offline record is the server's for its line: status, body (vectors to float rounding) and error."""
    for mine in offline_records:
        code = (mine["error"] or {}).get("code")
        theirs = server_records["duplicate" if code == "duplicate_custom_id" else mine["custom_id"]]
        assert (mine["custom_id"], code) == (theirs["custom_id"], (theirs["error"] or {}).get("code"))
        assert (mine["response"] is None) == (theirs["response"] is None)
        if mine["response"] is None:
            continue
        a, b = mine["response"]["body"], theirs["response"]["body"]
        assert mine["response"]["status_code"] == theirs["response"]["status_code"] == 200
        assert {k: v for k, v in a.items() if k != "data"} == {k: v for k, v in b.items() if k != "data"}
        va, vb = np.array(a["data"][0]["embedding"]), np.array(b["data"][0]["embedding"])
        assert float(va @ vb / np.linalg.norm(va) / np.linalg.norm(vb)) >= 0.99999, mine["custom_id"]


def expected_order() -> list[str | None]:
    return [None if n == 100 else "c5" if n == 200 else f"c{n}" for n in range(LINES)]  # 100: no custom_id


@pytest.fixture(scope="module")
def jsonl_run(tiny_model: Path, input_file: Path, tmp_path_factory: pytest.TempPathFactory,
              server: Server) -> list[dict[str, Any]]:
    """The corpus through ``inferd batch``: SIGKILLed after two chunks, the output torn, then run to the end.
    (``server``: started first, so that it loads while these run.)"""
    work = tmp_path_factory.mktemp("offline")
    out = work / "out.jsonl"
    command = batch_command(tiny_model, str(input_file), "--out", str(out), "--chunk-lines", "16")
    with open(work / "first.log", "wb") as log:
        first = subprocess.Popen(command, env=batch_env(), cwd=work, stdout=log, stderr=subprocess.STDOUT)
    try:
        def progress() -> int:
            assert first.poll() is None, (work / "first.log").read_text()
            try:
                return json.loads(checkpoint.checkpoint_path(out).read_bytes())["lines_done"]
            except (FileNotFoundError, ValueError):
                return 0
        wait_for(lambda: progress() >= 32, 120, "two chunks committed", every=0.005)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    killed_at = json.loads(checkpoint.checkpoint_path(out).read_bytes())
    assert 32 <= killed_at["lines_done"] < LINES, killed_at  # stopped mid-run, with lines still to do
    with open(out, "ab") as f:  # what a crash in the middle of a chunk's write leaves behind
        f.write(b'{"id":"batch_req_torn","custom_id":"c99","response":{"status_')
    second = subprocess.run(command, env=batch_env(), cwd=work, capture_output=True, timeout=300)
    assert second.returncode == 1, second.stderr.decode()[-3000:]  # 1: some lines failed (the three broken ones)
    assert f"{LINES} lines, {LINES - 3} answered, 3 failed" in second.stderr.decode()
    assert not checkpoint.checkpoint_path(out).exists()
    return read_records(out)


def test_kill_9_mid_run_then_rerun_gives_every_line_once_equal_to_the_server_s_batch(
        jsonl_run: list[dict[str, Any]], server_records: dict[str, Any]) -> None:
    assert [r["custom_id"] for r in jsonl_run] == expected_order()
    assert len({r["id"] for r in jsonl_run}) == LINES
    assert_same(jsonl_run, server_records)


def test_inferd_jobs_lists_and_refuses_to_cancel_the_finished_job_on_a_real_server(
        server: Server, server_records: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    batch_id = server_records["batch_id"]
    capsys.readouterr()
    assert cli.main(["jobs", "--url", server.url, "--key", KEY, "list", "--json"]) == 0
    (listed,) = [b for b in json.loads(capsys.readouterr().out)["data"] if b["id"] == batch_id]
    assert listed["status"] == "completed"
    assert listed["request_counts"] == {"total": LINES, "completed": LINES - 3, "failed": 3}
    assert cli.main(["jobs", "cancel", batch_id, "--url", server.url, "--key", KEY]) == 1
    assert f"409 batch {batch_id!r} is already completed" in capsys.readouterr().err
    assert cli.main(["jobs", "show", batch_id, "--url", server.url, "--key", "not-the-key"]) == 1
    assert "401" in capsys.readouterr().err


def run_args(input_path: Path, out: Path, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"input": input_path, "out": out, "endpoint": "/v1/embeddings", "chunk_lines": 32,
                                 "restart": False, "no_progress": True, **kw})


class Stopped(Exception):
    """Stands for a kill between a chunk's part file and its checkpoint."""


def stop_after_chunks(monkeypatch: pytest.MonkeyPatch, chunks: int) -> None:
    """A kill after ``chunks`` chunks are committed, as the next chunk's checkpoint is to be written (its output is
    in place)."""
    save, committed = checkpoint.save, []

    def save_then_stop(path: Path, cp: checkpoint.Checkpoint) -> None:
        if cp.lines_done > 0:  # a chunk's checkpoint, not a run's first
            if len(committed) == chunks:
                raise Stopped
            committed.append(cp)
        save(path, cp)

    monkeypatch.setattr(checkpoint, "save", save_then_stop)


def test_parquet_in_and_out_stopped_between_a_part_and_its_checkpoint(
        tiny_model: Path, server_records: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [orjson.loads(line) for line in corpus() if line and not line.startswith(b"{not")]
    rows = [r for r in rows if r["custom_id"] != "c250" and r["body"].get("input") != "again"]
    source = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"custom_id": [r["custom_id"] for r in rows],
                             "input": [r["body"]["input"] for r in rows]}), source)
    out = tmp_path / "out.parquet"
    settings = make_settings(tiny_model, jobs={"enabled": False}, runtime={"torch_threads": 1})
    stop_after_chunks(monkeypatch, 2)  # the third chunk's part is in place, its checkpoint never written
    with pytest.raises(Stopped):
        asyncio.run(offline.batch_file(run_args(source, out), settings))
    assert len(list((tmp_path / "out.parquet.parts").glob("*.parquet"))) == 3
    monkeypatch.undo()
    assert asyncio.run(offline.batch_file(run_args(source, out), settings)) == 0
    got = read_records(out)
    assert [r["custom_id"] for r in got] == [r["custom_id"] for r in rows]
    assert_same(got, server_records)


@pytest.mark.parametrize(("content", "kw", "says"), [
    (b"hello\nworld\n", {}, "not JSONL"),
    (b"\n\n", {}, "no lines"),
    (b'{"custom_id": "a"}\n' + b"x" * 2000 + b"\n", {}, "line 2 is 2000 bytes; at most 1024"),
    (b'{"custom_id": "a"}\n', {"endpoint": "/v1/chat/completions"}, "not one a batch may run"),
])
def test_a_file_or_endpoint_it_cannot_run_is_refused_before_the_model_loads(
        tmp_path: Path, content: bytes, kw: dict[str, Any], says: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(content)
    settings = make_settings("/nowhere", jobs={"enabled": False, "max_line_bytes": 1024})
    with pytest.raises(FileRefused, match=says):
        asyncio.run(offline.batch_file(run_args(source, tmp_path / "out.jsonl", **kw), settings))
    assert not (tmp_path / "out.jsonl").exists()


def test_a_finished_run_another_input_s_checkpoint_or_an_input_or_output_it_cannot_use_is_refused(
        tmp_path: Path, input_file: Path) -> None:
    settings = make_settings("/nowhere", jobs={"enabled": False})
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"{}\n")  # a finished run's output: no checkpoint beside it
    with pytest.raises(BadFile, match="exists and no checkpoint is beside it"):
        asyncio.run(offline.batch_file(run_args(input_file, out), settings))
    checkpoint.save(out, checkpoint.Checkpoint("0" * 64, 5, "/v1/embeddings", 1))
    with pytest.raises(checkpoint.CheckpointError, match="belongs to another run"):
        asyncio.run(offline.batch_file(run_args(input_file, out), settings))
    with pytest.raises(BadFile, match="no such file"):
        asyncio.run(offline.batch_file(run_args(tmp_path / "absent.jsonl", out), settings))
    with pytest.raises(BadFile, match="is the input file"):
        asyncio.run(offline.batch_file(run_args(input_file, input_file), settings))
    with pytest.raises(BadFile, match="no folder"):
        asyncio.run(offline.batch_file(run_args(input_file, tmp_path / "absent" / "out.jsonl"), settings))


def test_a_resume_with_other_model_settings_or_another_model_is_refused_naming_what_changed(
        tiny_model: Path, input_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue: a resume with ``--set model.normalize=false`` appended unnormalized vectors to normalized ones."""
    folder = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    out = tmp_path / "out.jsonl"
    settings = make_settings(folder, jobs={"enabled": False}, runtime={"torch_threads": 1})
    stop_after_chunks(monkeypatch, 2)
    with pytest.raises(Stopped):
        asyncio.run(offline.batch_file(run_args(input_file, out), settings))
    monkeypatch.undo()
    assert checkpoint.load(out).lines_done == 64
    unnormalized = make_settings(folder, jobs={"enabled": False}, runtime={"torch_threads": 1},
                                 model={"normalize": False})
    with pytest.raises(checkpoint.CheckpointError) as refused:
        asyncio.run(offline.batch_file(run_args(input_file, out), unnormalized))
    assert "normalize True, now False" in str(refused.value) and "--restart" in str(refused.value)
    write_tiny_bert(folder, seed=2)  # other weights in the same folder, the same settings
    with pytest.raises(checkpoint.CheckpointError, match=r"\.content '[0-9a-f]{64}', now '[0-9a-f]{64}'"):
        asyncio.run(offline.batch_file(run_args(input_file, out), settings))
    assert checkpoint.load(out).lines_done == 64  # refused before any line ran: the checkpoint is as it was


def test_a_run_stopped_before_its_first_chunk_s_checkpoint_runs_again_from_the_first_line(
        tiny_model: Path, input_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue: OUT was made before the model loaded, so a run killed (or refused) before its first checkpoint left an
    OUT that the same command took for a finished run's, and refused."""
    out = tmp_path / "out.jsonl"
    missing = make_settings(tmp_path / "no-model", jobs={"enabled": False}, model={"exit_on_load_failure": True})
    with pytest.raises(offline.ModelNotLoaded, match="no-model does not exist"):
        asyncio.run(offline.batch_file(run_args(input_file, out), missing))
    assert not out.exists() and checkpoint.load(out) is None
    settings = make_settings(tiny_model, jobs={"enabled": False}, runtime={"torch_threads": 1})
    stop_after_chunks(monkeypatch, 0)  # the first chunk written to OUT, its checkpoint not
    with pytest.raises(Stopped):
        asyncio.run(offline.batch_file(run_args(input_file, out), settings))
    monkeypatch.undo()
    assert out.stat().st_size > 0
    assert asyncio.run(offline.batch_file(run_args(input_file, out), settings)) == 1  # 1: the three broken lines
    assert [r["custom_id"] for r in read_records(out)] == expected_order()


def test_a_model_that_does_not_load_refuses_the_run_with_its_reason_on_one_line(
        input_file: Path, tmp_path: Path) -> None:
    """Issue: ``--model-path /nonexistent`` exited 3 through os._exit from a background load, among log lines (with
    ``--load-mode eager``: "inferd batch: 3"), leaving an OUT behind."""
    out = tmp_path / "out.jsonl"
    for extra in ((), ("--load-mode", "background")):
        run = subprocess.run(batch_command(tmp_path / "nonexistent", str(input_file), "--out", str(out), *extra),
                             env=batch_env(), cwd=tmp_path, capture_output=True, timeout=120)
        err = run.stderr.decode()
        assert run.returncode == 2, err[-3000:]
        assert err.splitlines()[-1] == f"inferd batch: the model did not load: model folder {tmp_path}/nonexistent " \
                                       "does not exist"
        assert "Traceback" not in err and not out.exists() and checkpoint.load(out) is None


@pytest.fixture(scope="module")
def long_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lines enough that a run of 8-line chunks is still going a second after its first checkpoint."""
    path = tmp_path_factory.mktemp("long") / "long.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"custom_id": f"l{n}", "method": "POST", "url": "/v1/embeddings",
                                            "body": {"input": " ".join(WORDS[n % 50:n % 50 + n % 9 + 1])}}) + b"\n"
                              for n in range(4_000)))
    return path


def start_batch(tiny_model: Path, source: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    """``inferd batch`` in a process of its own, returned once it has committed some lines (8-line chunks)."""
    with open(log, "wb") as f:
        # SIGINT as a terminal gives it (a process started in the background from a shell would ignore it).
        run = subprocess.Popen(batch_command(tiny_model, str(source), "--out", str(out), "--chunk-lines", "8"),
                               env=batch_env(), cwd=out.parent, stdout=f, stderr=subprocess.STDOUT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def progress() -> int:
        assert run.poll() is None, log.read_text()
        found = checkpoint.load(out) if checkpoint.checkpoint_path(out).exists() else None
        return found.lines_done if found else 0
    try:
        wait_for(lambda: progress() >= 16, 120, "two chunks committed", every=0.005)
    except BaseException:
        run.kill()
        raise
    return run


def test_a_second_run_on_the_same_out_is_refused_at_once_while_the_first_runs(
        tiny_model: Path, long_file: Path, tmp_path: Path) -> None:
    """Issue: two runs on one --out both wrote it, and one died renaming the other's checkpoint."""
    out = tmp_path / "out.jsonl"
    first = start_batch(tiny_model, long_file, out, tmp_path / "first.log")
    try:
        settings = make_settings(tiny_model, jobs={"enabled": False})
        with pytest.raises(BadFile, match=f"being written by another inferd batch \\(pid {first.pid}\\)"):
            asyncio.run(offline.batch_file(run_args(long_file, out), settings))
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait(10)


def test_ctrl_c_mid_run_says_how_far_it_got_exits_130_and_the_same_command_resumes(
        tiny_model: Path, long_file: Path, tmp_path: Path) -> None:
    """Issue: SIGINT printed two tracebacks and exited 1, the status of a run whose lines failed."""
    out = tmp_path / "out.jsonl"
    log = tmp_path / "first.log"
    first = start_batch(tiny_model, long_file, out, log)
    first.send_signal(signal.SIGINT)
    assert first.wait(60) == 130, log.read_text()[-3000:]
    done = checkpoint.load(out).lines_done
    assert log.read_text().splitlines()[-1] == (f"inferd batch: interrupted after {done} lines; run the same "
                                                "command to resume")
    assert "Traceback" not in log.read_text() and 16 <= done < 4_000
    again = subprocess.run(batch_command(tiny_model, str(long_file), "--out", str(out), "--chunk-lines", "8"),
                           env=batch_env(), cwd=tmp_path, capture_output=True, timeout=300)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert [r["custom_id"] for r in read_records(out)] == [f"l{n}" for n in range(4_000)]


def test_a_parquet_run_stopped_after_writing_out_but_before_removing_its_checkpoint_finishes_again(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue: finish() deleted the parts before the checkpoint was removed; stopped between the two, the same command
    was refused ("lacks parts its checkpoint counts") and the run could not be finished."""
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"custom_id": [f"p{n}" for n in range(40)], "input": [WORDS[n] for n in range(40)]}),
                   source)
    out = tmp_path / "out.parquet"
    settings = make_settings(tiny_model, jobs={"enabled": False}, runtime={"torch_threads": 1})

    def stopped(path: Path) -> None:
        raise Stopped

    monkeypatch.setattr(checkpoint, "remove", stopped)
    with pytest.raises(Stopped):
        asyncio.run(offline.batch_file(run_args(source, out), settings))
    monkeypatch.undo()
    assert checkpoint.load(out).finished and out.exists()
    assert asyncio.run(offline.batch_file(run_args(source, out), settings)) == 0
    assert [r["custom_id"] for r in read_records(out)] == [f"p{n}" for n in range(40)]
    assert checkpoint.load(out) is None and not (tmp_path / "out.parquet.parts").exists()
