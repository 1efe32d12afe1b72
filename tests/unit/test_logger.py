"""JSON and text log lines, the request id in every line, and request text kept out of logs by default."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from settingskit import make_settings

from inferd.api.app import create_app
from inferd.utils.logger import JsonFormatter, RequestIdFilter, TextFormatter, configure_logging, request_id_var

SECRET_TEXT = "the confidential river sentence"


def make_record(msg: str = "hello %s", args: tuple = ("world",), exc_info=None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("inferd.test", logging.INFO, __file__, 10, msg, args, exc_info)
    record.__dict__.update(extra)
    RequestIdFilter().filter(record)
    return record


def test_json_line_carries_the_request_id_and_extras() -> None:
    token = request_id_var.set("req-123")
    try:
        record = make_record(endpoint="/predict", status=200, duration_ms=1.5, path=Path("/x"))
    finally:
        request_id_var.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello world"
    assert (line["level"], line["logger"]) == ("INFO", "inferd.test")
    assert line["request_id"] == "req-123"
    assert (line["endpoint"], line["status"], line["duration_ms"]) == ("/predict", 200, 1.5)
    assert line["path"] == "/x"  # what JSON cannot hold is written as text, never an error
    assert line["time"].endswith("Z") and "T" in line["time"]


def test_json_line_outside_a_request_has_a_null_request_id() -> None:
    line = json.loads(JsonFormatter().format(make_record()))
    assert line["request_id"] is None


def test_exceptions_are_one_json_field() -> None:
    try:
        raise ValueError("broken")
    except ValueError:
        record = make_record("failed", (), exc_info=sys.exc_info())
    text = JsonFormatter().format(record)
    assert "\n" not in text  # one line per event, whatever the traceback
    line = json.loads(text)
    assert "ValueError: broken" in line["exception"]


def test_text_line_appends_extras_and_skips_empty_ones() -> None:
    text = TextFormatter().format(make_record(status=200, version=None))
    assert text.endswith("hello world status=200")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    names = ("inferd", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = {n: (lg.handlers[:], lg.level, lg.propagate) for n in names for lg in [logging.getLogger(n)]}
    yield
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.mark.parametrize(("fmt", "formatter"), [("json", JsonFormatter), ("text", TextFormatter)])
def test_configure_logging_picks_the_format(restore_logging: None, fmt: str, formatter: type) -> None:
    configure_logging("WARNING", fmt)
    inferd = logging.getLogger("inferd")
    assert [type(h.formatter) for h in inferd.handlers] == [formatter]
    assert inferd.level == logging.WARNING
    assert logging.getLogger("uvicorn.access").handlers == []  # replaced by inferd's own access log


# -- the access log and the batch line, through the app (tiny model, in-process) ---------------------------


def run_requests(tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                 log_inputs: bool) -> list[logging.LogRecord]:
    settings = make_settings(tiny_model, layered="dev", model={"device": "cpu", "load_mode": "eager"},
                             server={"log_inputs": log_inputs}, batching={"min_padding_efficiency": 0.0})
    caplog.handler.addFilter(RequestIdFilter())  # as configure_logging's handler does
    with caplog.at_level(logging.INFO, logger="inferd"), TestClient(create_app(settings)) as client:
        r = client.post("/predict", json={"texts": [SECRET_TEXT, "the cat"]}, headers={"X-Request-ID": "rid-1"})
        assert r.status_code == 200, r.text
        r = client.post("/predict", json={"texts": [SECRET_TEXT, ""]})
        assert r.status_code == 422
    return list(caplog.records)


def test_access_and_batch_lines_have_their_fields_and_no_input_text(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = run_requests(tiny_model, tmp_path, caplog, log_inputs=False)
    access = [r for r in records if r.name == "inferd.access" and getattr(r, "endpoint", None) == "/predict"]
    assert [r.status for r in access] == [200, 422]
    line = json.loads(JsonFormatter().format(access[0]))
    assert line["request_id"] == "rid-1"
    for key in ("endpoint", "status", "duration_ms", "items", "batch_size", "queue_ms", "preprocess_ms",
                "inference_ms", "postprocess_ms"):
        assert key in line, key
    assert (line["items"], line["batch_size"]) == (2, 2)
    batches = [r for r in records if r.name == "inferd.batch"]
    assert batches and all(r.batch_size >= 1 and r.batch_tokens > 0 and r.duration_ms >= 0 for r in batches)
    formatted = "\n".join(JsonFormatter().format(r) for r in records)
    assert SECRET_TEXT not in formatted and "confidential" not in formatted
    assert "inputs" not in line


def test_log_inputs_puts_the_texts_in_the_access_line(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = run_requests(tiny_model, tmp_path, caplog, log_inputs=True)
    access = [r for r in records if r.name == "inferd.access" and getattr(r, "endpoint", None) == "/predict"]
    assert access[0].inputs == [SECRET_TEXT, "the cat"]
    # The refused request (an empty text) may be refused before its texts are handed on (routes' precheck);
    # if its line has inputs at all, they are its own.
    assert getattr(access[1], "inputs", [SECRET_TEXT, ""]) == [SECRET_TEXT, ""]


# -- log injection: no client-supplied value can start a line or hide text (issue 8, item 4) ----------------

FORGED = "2026-12-01 00:00:00,000 CRITICAL inferd.security: admin login ok"
# Every character a line-oriented reader or a terminal acts on: CR, LF, the other C0 controls (ESC starts
# terminal escapes), DEL, C1 (NEL is a line break to Unicode), the Unicode line and paragraph separators,
# and the bidirectional overrides that reorder what a terminal shows.
UNSAFE = ["\n", "\r", "\r\n", "\x00", "\x0b", "\x0c", "\x1b[2J", "\x1c", "\x1e", "\x7f", "\x85", "\x9b",
          "\u2028", "\u2029", "\u202e", "\u2066"]
FORMATTERS = [JsonFormatter, TextFormatter]


def _unsafe_chars(text: str) -> list[str]:
    return [c for c in text if ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f or c in "\u2028\u2029\u202e\u2066"]


def rendered_value(fmt: type[logging.Formatter], out: str, key: str | None = None) -> str:
    """The text a reader sees for the message (or the extra ``key``) in one formatted line."""
    if fmt is JsonFormatter:
        line = json.loads(out)
        return str(line["message"] if key is None else line[key])
    return out


@pytest.mark.parametrize("fmt", FORMATTERS)
@pytest.mark.parametrize("bad", UNSAFE)
def test_a_client_value_in_the_message_cannot_break_or_hide_a_line(fmt: type[logging.Formatter], bad: str) -> None:
    path = f"/x{bad}{FORGED}"
    out = fmt().format(make_record("%s %s %d", ("GET", path, 404)))
    assert len(out.splitlines()) == 1  # JSON's own escapes keep C0 out; C1 and U+2028 are the formatter's
    seen = rendered_value(fmt, out)
    assert _unsafe_chars(seen) == [], seen
    assert FORGED in seen  # the value is escaped, not dropped: the operator sees what was sent
    assert "\\x" in seen or "\\u" in seen


@pytest.mark.parametrize("fmt", FORMATTERS)
@pytest.mark.parametrize("bad", ["\n", "\x85", "\u2028", "\x1b"])
def test_extras_are_escaped_whatever_their_type(fmt: type[logging.Formatter], bad: str) -> None:
    record = make_record(path=f"/a{bad}b", model=[f"m{bad}", {"k": f"v{bad}"}], where=Path(f"/p{bad}q"),
                         status=404)
    out = fmt().format(record)
    assert len(out.splitlines()) == 1
    for key in ("path", "model", "where"):
        assert _unsafe_chars(rendered_value(fmt, out, key) if fmt is JsonFormatter else out) == []
    if fmt is JsonFormatter:
        assert json.loads(out)["status"] == 404  # numbers stay numbers


def test_the_request_id_is_escaped_too() -> None:
    token = request_id_var.set(f"rid\n{FORGED}")
    try:
        record = make_record()
    finally:
        request_id_var.reset(token)
    for fmt in FORMATTERS:
        assert len(fmt().format(record).splitlines()) == 1


@pytest.mark.parametrize("fmt", FORMATTERS)
def test_a_traceback_quoting_a_client_cannot_forge_a_line(fmt: type[logging.Formatter]) -> None:
    try:
        raise ValueError(f"bad model name x\n{FORGED}\u2028{FORGED}")
    except ValueError:
        record = make_record("failed", (), exc_info=sys.exc_info())
    out = fmt().format(record)
    if fmt is JsonFormatter:
        text = json.loads(out)["exception"]
        assert len(out.splitlines()) == 1 and "\u2028" not in text
        assert "Traceback" in text and "ValueError" in text  # one field: a readable traceback inside it
    else:
        first, *lines = out.split("\n")
        assert first.endswith("failed")
        assert "\u2028" not in out
        assert lines and all(line.startswith("    ") for line in lines)  # continuation, never a line start
        assert not any(line.startswith(FORGED) for line in lines)
