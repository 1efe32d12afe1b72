"""``inferd jobs list | show | cancel``: the requests it makes of /v1/batches and what it prints, against a stand-in
answering in OpenAI's Batch API shapes (tests/integration/test_batch_offline.py drives it against a real server);
the settings ``inferd batch`` runs with; check-config's mask on the jobs store's URL."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ROOT, free_port

from inferd import cli
from inferd.jobs import cli as jobs_cli
from inferd.jobs import offline
from inferd.settings import Settings

CONFIGS = ROOT / "configs"


def job(n: int, status: str = "in_progress", done: int = 0, failed: int = 0, total: int = 10) -> dict[str, Any]:
    return {"id": f"batch_{n}", "object": "batch", "endpoint": "/v1/embeddings", "status": status,
            "input_file_id": f"file-in{n}", "output_file_id": f"file-out{n}" if status == "completed" else None,
            "error_file_id": None, "completion_window": "24h", "created_at": 1_700_000_000 + n,
            "request_counts": {"total": total, "completed": done, "failed": failed}}


class Stand:
    """A /v1/batches stand-in: records each request and answers with ``answer(request)``."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response]) -> None:
        self.requests: list[httpx.Request] = []
        self.answer = answer

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.answer(request)


def run(argv: list[str], stand: Stand | None = None) -> int:
    args = cli.build_parser().parse_args(["jobs", *argv])
    return jobs_cli.main(args, httpx.MockTransport(stand) if stand else None, sleep=lambda s: None)


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERD_URL", raising=False)
    monkeypatch.delenv("INFERD_API_KEY", raising=False)


def test_list_all_follows_the_pages_and_sends_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    pages = {None: [job(3), job(2)], "batch_2": [job(1, "completed", 10, 0)]}

    def answer(request: httpx.Request) -> httpx.Response:
        data = pages[request.url.params.get("after")]
        return httpx.Response(200, json={"object": "list", "data": data, "first_id": data[0]["id"],
                                         "last_id": data[-1]["id"], "has_more": data[-1]["id"] != "batch_1"})

    stand = Stand(answer)
    assert run(["--url", "http://jobs.test", "--key", "k1", "list", "--all", "--limit", "2"], stand) == 0
    assert [(r.method, r.url.path, r.url.params.get("after"), r.url.params.get("limit")) for r in stand.requests] == [
        ("GET", "/v1/batches", None, "2"), ("GET", "/v1/batches", "batch_2", "2")]
    assert {r.headers["authorization"] for r in stand.requests} == {"Bearer k1"}
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["ID", "STATUS", "ENDPOINT", "LINES", "CREATED"]
    assert [row.split()[:2] for row in rows] == [["batch_3", "in_progress"], ["batch_2", "in_progress"],
                                                 ["batch_1", "completed"]]
    assert "10+0 failed/10" in rows[2]


def test_list_says_how_to_see_more_and_json_is_the_server_s(capsys: pytest.CaptureFixture[str]) -> None:
    stand = Stand(lambda r: httpx.Response(200, json={"object": "list", "data": [job(5)], "has_more": True}))
    # --url and --key after the action are as good as before it; the environment gives them otherwise.
    assert run(["list", "--limit", "1", "--url", "http://jobs.test"], stand) == 0
    assert "(more: --after batch_5, or --all)" in capsys.readouterr().out
    assert "authorization" not in stand.requests[0].headers  # no key given: none sent
    assert run(["list", "--json"], stand) == 0
    assert json.loads(capsys.readouterr().out)["data"] == [job(5)]
    assert str(stand.requests[-1].url).startswith(jobs_cli.DEFAULT_URL)


def test_show_follow_draws_progress_until_the_job_ends(capsys: pytest.CaptureFixture[str]) -> None:
    states = iter([job(7, "validating", total=0), job(7, done=4, failed=1), job(7, done=8, failed=1),
                   job(7, "completed", done=9, failed=1)])
    stand = Stand(lambda r: httpx.Response(200, json=next(states)))
    assert run(["show", "batch_7", "--follow", "--key", "k"], stand) == 0
    assert [r.url.path for r in stand.requests] == ["/v1/batches/batch_7"] * 4
    out, err = capsys.readouterr()
    assert "10/10" in err and "status=completed" in err  # the bar reached the total the server gave
    assert "status: completed" in out and "output_file_id: file-out7" in out and "lines: 9+1 failed/10" in out


@pytest.mark.parametrize("end", ["failed", "cancelled", "expired"])
def test_show_follow_exits_1_when_the_job_did_not_complete(end: str, capsys: pytest.CaptureFixture[str]) -> None:
    stand = Stand(lambda r: httpx.Response(200, json=job(8, end, done=2, total=10)))
    assert run(["show", "batch_8", "--follow"], stand) == 1
    assert f"status: {end}" in capsys.readouterr().out


def test_cancel_posts_and_prints_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    stand = Stand(lambda r: httpx.Response(200, json=job(9, "cancelling", done=3)))
    assert run(["cancel", "batch_9", "--json"], stand) == 0
    (request,) = stand.requests
    assert (request.method, request.url.path) == ("POST", "/v1/batches/batch_9/cancel")
    assert json.loads(capsys.readouterr().out)["status"] == "cancelling"


def test_a_refusal_prints_the_server_s_reason_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    error = {"error": {"message": "no batch 'batch_x'", "type": "not_found_error", "code": "not_found", "param": None}}
    stand = Stand(lambda r: httpx.Response(404, json=error))
    assert run(["show", "batch_x"], stand) == 1
    err = capsys.readouterr().err
    assert "inferd jobs show: GET /v1/batches/batch_x: 404 no batch 'batch_x'" in err
    assert run(["cancel", "batch_x"], Stand(lambda r: httpx.Response(502, text="<html>bad gateway</html>"))) == 1
    assert "502 <html>bad gateway</html>" in capsys.readouterr().err
    # Another server's page: its first line, not the page (the HTML 404 spread over the terminal).
    page = "\n<!DOCTYPE html>\n<html><body>\n<h1>Not Found</h1>\n</body></html>\n"
    assert run(["show", "batch_x"], Stand(lambda r: httpx.Response(404, text=page))) == 1
    assert capsys.readouterr().err == "inferd jobs show: GET /v1/batches/batch_x: 404 <!DOCTYPE html>\n"


@pytest.mark.parametrize(("batch_id", "path"), [("../files", "/v1/batches/..%2Ffiles"),
                                                ("x?limit=1", "/v1/batches/x%3Flimit%3D1")])
def test_an_id_is_one_path_segment_and_an_answer_that_is_not_a_batch_is_refused(
        batch_id: str, path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue: ``show ../files`` fetched /v1/files and printed a job of None fields (exit 0); ``x?limit=1`` sent a
    query."""
    files = {"object": "list", "data": [], "has_more": False}  # what /v1/files answers
    stand = Stand(lambda r: httpx.Response(200, json=files))
    for action in ("show", "cancel"):
        assert run([action, batch_id], stand) == 1
        assert "the answer is not a batch (object 'list')" in capsys.readouterr().err
    assert [(r.url.raw_path.decode(), r.url.query) for r in stand.requests] == [(path, b""), (path + "/cancel", b"")]
    assert run(["show", ".."], stand) == 1 and len(stand.requests) == 2  # refused before any request
    assert "'..' is not a batch id" in capsys.readouterr().err


def test_a_server_that_is_not_there_is_named(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a real connection refused
    monkeypatch.setenv("INFERD_URL", url)
    assert cli.main(["jobs", "list"]) == 1
    assert f"inferd jobs list: cannot reach {url}" in capsys.readouterr().err


def test_a_bad_limit_is_refused_before_any_request(capsys: pytest.CaptureFixture[str]) -> None:
    stand = Stand(lambda r: httpx.Response(200, json={"data": []}))
    assert run(["list", "--limit", "0"], stand) == 1
    assert stand.requests == [] and "--limit must be at least 1" in capsys.readouterr().err


def test_check_config_masks_the_jobs_database_url() -> None:
    # The URL carries the store's password (Kubernetes puts it in a Secret); check-config prints the rest.
    settings = Settings.model_validate({"jobs": {"database_url": "postgresql+psycopg://inferd:pa55@db:5432/jobs"}})
    data = cli.redacted(settings)
    assert data["jobs"]["database_url"] == "***" and "pa55" not in str(data)
    assert cli.redacted(Settings())["jobs"]["database_url"] is None  # unset stays visibly unset


def test_batch_runs_without_keys_tenants_or_a_jobs_store_whatever_the_configuration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No port is open: keys would refuse every line, a tenant's limits would throttle the run.
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n- name: a\n  keys: [k-a]\n")
    monkeypatch.setenv("INFERD_CONFIG_DIR", str(CONFIGS))
    monkeypatch.setenv("INFERD__SERVER__TENANTS_FILE", str(tenants))
    args = cli.build_parser().parse_args(["batch", "in.jsonl", "--out", "out.jsonl", "--model-path", "/m",
                                          "--set", "server.api_keys=[k1]", "--set", "jobs.chunk_size=7"])
    settings = offline.offline_settings(args)
    assert (settings.server.api_keys, settings.server.tenants, settings.server.tenants_file) == ((), (), None)
    assert not settings.jobs.enabled and settings.model.exit_on_load_failure
    # Loaded before the first line, whatever the configuration: the checkpoint names the model that answers.
    assert settings.model.load_mode == "eager"
    assert settings.model.path == "/m" and settings.jobs.chunk_size == 7  # the flags still apply
    assert settings.server.log_level == "WARNING"  # the progress bar is the output


class Clock:
    """tqdm's clock and ``show --follow``'s sleep, as one: sleeping moves it on."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def follow(argv: list[str], stand: Stand, clock: Clock) -> int:
    return jobs_cli.main(cli.build_parser().parse_args(["jobs", "show", "batch_7", "--follow", *argv]),
                         httpx.MockTransport(stand), sleep=clock.sleep)


def test_follow_s_rate_counts_the_lines_done_while_followed(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Issue: the lines done before the first answer were counted as done in its first refresh (a rate of millions)."""
    import tqdm.std

    clock = Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    states = iter([job(7, done=9000, total=10_000), job(7, done=9500, total=10_000),
                   job(7, "completed", done=10_000, total=10_000)])
    assert follow([], Stand(lambda r: httpx.Response(200, json=next(states))), clock) == 0
    err = capsys.readouterr().err
    rates = [float(n) * {"": 1, "k": 1e3, "M": 1e6}[unit] for n, unit in re.findall(r"([\d.]+)([kM]?)line/s", err)]
    assert rates and max(rates) == 500  # 1000 lines in the 2 s followed
    assert "10000/10000" in err


def test_ctrl_c_during_follow_is_one_line_and_exit_130(capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    args = cli.build_parser().parse_args(["jobs", "show", "batch_7", "--follow"])
    stand = Stand(lambda r: httpx.Response(200, json=job(7, done=1)))
    assert jobs_cli.main(args, httpx.MockTransport(stand), sleep=interrupted) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "inferd jobs show: interrupted"


@pytest.mark.parametrize("interval", ["0", "-1", "nan"])
def test_an_interval_of_no_time_is_refused_by_the_parser(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["jobs", "show", "batch_7", "--follow", "--interval", interval])
    assert exited.value.code == 2
    assert f"--interval: must be more than 0, not {interval}" in capsys.readouterr().err


def test_follow_asks_an_unreachable_server_again_for_a_minute_then_gives_up(capsys: pytest.CaptureFixture[str]) -> None:
    answers = iter([job(7, done=1), "down", "down", job(7, "completed", done=10)])

    def blip(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if answer == "down":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=answer)

    clock = Clock()
    assert follow(["--interval", "5"], Stand(blip), clock) == 0
    assert "status: completed" in capsys.readouterr().out

    first = iter([job(7, done=1)])

    def down(request: httpx.Request) -> httpx.Response:  # answers once, then never again
        answer = next(first, None)
        if answer is None:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=answer)

    clock = Clock()
    assert follow(["--interval", "5"], Stand(down), clock) == 1
    assert sum(clock.slept[1:]) == jobs_cli.FOLLOW_GRACE_S  # the intervals after the first failure
    assert "cannot reach http://127.0.0.1:8000: connection refused (for 60 s" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--url", "http://[::1", "list"], "inferd jobs list: --url 'http://[::1' is not a URL"),
    (["--key", "clé", "list"], "inferd jobs list: --key has characters other than ASCII"),
])
def test_a_url_or_key_that_cannot_be_sent_is_one_line(argv: list[str], says: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    stand = Stand(lambda r: httpx.Response(200, json={"data": []}))
    assert run(argv, stand) == 1 and stand.requests == []
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(says)


def test_a_job_being_cancelled_shows_when_the_cancel_was_asked() -> None:
    shown = jobs_cli.format_job({**job(4, "cancelling"), "cancelling_at": 1_700_000_100})
    assert "cancelling_at: 2023-11-14 22:15:00Z" in shown.splitlines()
