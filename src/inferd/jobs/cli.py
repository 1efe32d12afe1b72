"""``inferd jobs list | show | cancel``: a client of a running server's ``/v1/batches`` (OpenAI's Batch API),
and the flags of ``inferd batch`` (the same job without a server: jobs/offline.py runs it).

``inferd jobs`` is an HTTP client and nothing else: it finds the server by ``--url`` (or ``$INFERD_URL``) and
authenticates with ``--key`` (or ``$INFERD_API_KEY``), so it sees exactly the jobs that key's tenant sees.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from tqdm import tqdm

from inferd.config_flags import add_config_flags

DEFAULT_URL = "http://127.0.0.1:8000"
# ``show --follow``: a server that cannot be reached (a restart, a network blip) is asked again for this long.
FOLLOW_GRACE_S = 60.0
# OpenAI's batch states after which a batch never changes again.
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


class JobsError(Exception):
    """The server could not be reached or refused: the message is what the user reads."""


class Unreachable(JobsError):
    """No answer came (connection refused or cut, a timeout): worth asking again, unlike a refusal."""


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # 0 polled without pause; a negative one was a ValueError traceback from sleep
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def add_parsers(sub: Any) -> None:
    """``inferd jobs`` and ``inferd batch`` on the CLI's subparsers."""
    jobs = sub.add_parser("jobs", help="list, inspect and cancel a server's batch jobs (see docs/batch-jobs.md)")
    _client_flags(jobs, None)
    actions = jobs.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="the jobs, newest first")
    listing.add_argument("--limit", type=int, default=20, help="jobs per page (default 20)")
    listing.add_argument("--after", help="start after this job id (paging)")
    listing.add_argument("--all", action="store_true", help="every page, not only the first")
    show = actions.add_parser("show", help="one job: state, progress, output and error files")
    show.add_argument("batch_id")
    show.add_argument("--follow", action="store_true",
                      help="poll until the job ends, with a progress bar on stderr; exit 0 only if it completed")
    show.add_argument("--interval", type=_positive, default=1.0, help="seconds between polls with --follow")
    cancel = actions.add_parser("cancel", help="cancel a job (it stops within one chunk)")
    cancel.add_argument("batch_id")
    for action in (listing, show, cancel):
        # SUPPRESS: given before the action (`inferd jobs --url X list`) it must not be reset here.
        _client_flags(action, argparse.SUPPRESS)
        action.add_argument("--json", action="store_true", help="print the server's JSON")

    batch = sub.add_parser("batch", help="run a JSONL or Parquet file through the model here, with no server "
                                         "(see docs/batch-jobs.md)")
    add_config_flags(batch, server=False)
    batch.add_argument("input", type=Path, metavar="IN", help="input file: .jsonl (OpenAI batch lines) or .parquet")
    batch.add_argument("--out", type=Path, required=True, help="output file: .jsonl or .parquet (by its suffix)")
    # Checked by jobs/lines.py's table of endpoints when the run starts (importing it here would slow every command).
    batch.add_argument("--endpoint", default="/v1/embeddings",
                       help="the endpoint every line goes to: /v1/embeddings (default), /v1/rerank, /v1/encode or "
                            "/v1/classify")
    batch.add_argument("--chunk-lines", type=int, default=256,
                       help="lines per committed chunk: what a crash may have to run again (default 256)")
    batch.add_argument("--restart", action="store_true",
                       help="discard an existing checkpoint and output and start from the first line")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")


def _client_flags(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("--url", default=default, help=f"the server (default $INFERD_URL or {DEFAULT_URL})")
    p.add_argument("--key", default=default, help="API key (default $INFERD_API_KEY)")


class BatchesClient:
    """The three calls ``inferd jobs`` makes; any answer but a 2xx becomes a JobsError naming the server's reason."""

    def __init__(self, url: str, key: str | None, transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, transport=transport,
                                  timeout=httpx.Timeout(30.0, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def page(self, limit: int, after: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._call("GET", "/v1/batches", params=params)

    def pages(self, limit: int, after: str | None = None) -> Iterator[dict[str, Any]]:
        while True:
            page = self.page(limit, after)
            yield page
            data = page.get("data") or []
            if not page.get("has_more") or not data:
                return
            after = page.get("last_id") or data[-1]["id"]

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._batch("GET", f"/v1/batches/{_segment(batch_id)}")

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._batch("POST", f"/v1/batches/{_segment(batch_id)}/cancel")

    def _batch(self, method: str, path: str) -> dict[str, Any]:
        """A call answered by one batch: anything else (another route's answer, another server's) is refused,
        never printed as a job of None fields."""
        body = self._call(method, path)
        if body.get("object") != "batch":
            raise JobsError(f"{method} {path}: the answer is not a batch (object {body.get('object')!r}); is "
                            f"{self.url} an inferd server?")
        return body

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise Unreachable(f"cannot reach {self.url}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise JobsError(f"cannot reach {self.url}: {exc}") from exc
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code >= 400 or not isinstance(body, dict):
            error = body.get("error") if isinstance(body, dict) else None
            if isinstance(error, dict):
                reason = error.get("message")
            else:  # not inferd's JSON (a proxy's or another server's page): its first line, not the whole page
                reason = next((line.strip() for line in r.text.splitlines() if line.strip()), r.reason_phrase)[:200]
            raise JobsError(f"{method} {path}: {r.status_code} {reason}")
        return body


def _segment(batch_id: str) -> str:
    """The id as one path segment: as typed it reached other routes (``../files``) or sent a query (``x?limit=1``)."""
    if batch_id in ("", ".", ".."):  # dot segments that no quoting keeps: the URL would go up a level
        raise JobsError(f"{batch_id!r} is not a batch id")
    return quote(batch_id, safe="")


def main(args: argparse.Namespace, transport: httpx.BaseTransport | None = None,
         sleep: Callable[[float], None] = time.sleep) -> int:
    """``inferd jobs``: 0 done (``show --follow``: the job completed), 1 refused or the job did not complete."""
    url = getattr(args, "url", None) or os.environ.get("INFERD_URL") or DEFAULT_URL
    key = getattr(args, "key", None) or os.environ.get("INFERD_API_KEY")
    try:
        client = BatchesClient(url, key, transport)
    except httpx.InvalidURL as exc:
        print(f"inferd jobs {args.action}: --url {url!r} is not a URL ({exc})", file=sys.stderr)
        return 1
    except UnicodeEncodeError:  # a header is ASCII; the key is never echoed
        print(f"inferd jobs {args.action}: --key has characters other than ASCII; an API key has none",
              file=sys.stderr)
        return 1
    try:
        if args.action == "list":
            return _list(client, args)
        if args.action == "cancel":
            _print(client.cancel(args.batch_id), args.json)
            return 0
        if args.follow:
            return _follow(client, args, sleep)
        _print(client.get(args.batch_id), args.json)
        return 0
    except JobsError as exc:
        print(f"inferd jobs {args.action}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, mostly during --follow: the job goes on on the server
        print(f"inferd jobs {args.action}: interrupted", file=sys.stderr)
        return 130
    finally:
        client.close()


def _list(client: BatchesClient, args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise JobsError("--limit must be at least 1")
    pages = client.pages(args.limit, args.after) if args.all else iter([client.page(args.limit, args.after)])
    jobs: list[dict[str, Any]] = []
    has_more = False
    for page in pages:
        jobs += page.get("data") or []
        has_more = bool(page.get("has_more"))
    if args.json:
        print(json.dumps({"object": "list", "data": jobs, "has_more": has_more}, indent=2))
        return 0
    print(format_table(jobs))
    if has_more:
        print(f"(more: --after {jobs[-1]['id']}, or --all)")
    return 0


def _follow(client: BatchesClient, args: argparse.Namespace, sleep: Callable[[float], None]) -> int:
    job = client.get(args.batch_id)
    total, done, failed = _counts(job)
    # Made after the first answer and moved by deltas: from 0, the lines done before it were counted as done in its
    # first refresh's instant (an absurd rate).
    with tqdm(total=total or None, initial=done, unit="line", file=sys.stderr, dynamic_ncols=True,
              desc=args.batch_id) as bar:
        while True:
            total, done, failed = _counts(job)
            if total and bar.total != total:  # 0 while the file is still being validated
                bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix(status=job.get("status"), failed=failed, refresh=False)
            bar.refresh()
            if job.get("status") in TERMINAL:
                break
            job = _poll(client, args, sleep, bar)
    _print(job, args.json)
    return 0 if job.get("status") == "completed" else 1


def _counts(job: dict[str, Any]) -> tuple[int, int, int]:
    """(total, done, failed) lines of a job, done counting failed ones."""
    counts = job.get("request_counts") or {}
    failed = int(counts.get("failed") or 0)
    return int(counts.get("total") or 0), int(counts.get("completed") or 0) + failed, failed


def _poll(client: BatchesClient, args: argparse.Namespace, sleep: Callable[[float], None], bar: tqdm) -> dict[str, Any]:
    """The job after the next interval; a server that does not answer is asked again for FOLLOW_GRACE_S."""
    failing_since: float | None = None
    waited = 0.0  # the intervals slept since the first failure (the clock's figure is the other measure)
    while True:
        sleep(args.interval)
        try:
            return client.get(args.batch_id)
        except Unreachable as exc:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
            else:
                waited += args.interval
            if max(now - failing_since, waited) >= FOLLOW_GRACE_S:
                raise JobsError(f"{exc} (for {FOLLOW_GRACE_S:.0f} s; the job goes on on the server)") from exc
            bar.set_postfix(status="server unreachable, asking again", refresh=True)


def _print(job: dict[str, Any], as_json: bool) -> None:
    print(json.dumps(job, indent=2) if as_json else format_job(job))


def _when(stamp: Any) -> str:
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool):
        return "-"
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _progress(job: dict[str, Any]) -> str:
    counts = job.get("request_counts") or {}
    return f"{counts.get('completed', 0)}+{counts.get('failed', 0)} failed/{counts.get('total', 0)}"


def format_table(jobs: list[dict[str, Any]]) -> str:
    """One line per job: id, status, endpoint, done/failed/total, created (UTC)."""
    rows = [("ID", "STATUS", "ENDPOINT", "LINES", "CREATED")]
    rows += [(str(j.get("id")), str(j.get("status")), str(j.get("endpoint")), _progress(j),
              _when(j.get("created_at"))) for j in jobs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def format_job(job: dict[str, Any]) -> str:
    """A job as ``key: value`` lines: what a person checks (state, progress, files, errors, times)."""
    lines = [f"{k}: {job.get(k)}" for k in ("id", "status", "endpoint", "input_file_id", "output_file_id",
                                             "error_file_id", "completion_window")]
    lines.append(f"lines: {_progress(job)}")
    for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "cancelling_at",
                  "cancelled_at", "expires_at", "expired_at"):
        if job.get(stamp):
            lines.append(f"{stamp}: {_when(job[stamp])}")
    for error in ((job.get("errors") or {}).get("data") or []):
        where = f" (line {error['line']})" if error.get("line") is not None else ""
        lines.append(f"error{where}: {error.get('code')}: {error.get('message')}")
    return "\n".join(lines)
