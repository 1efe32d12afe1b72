"""Logging, configured once at start-up: JSON lines in prod, readable text in dev.

Library modules only call ``logging.getLogger(__name__)``; the request id travels in a context variable
so every line logged while serving a request carries it, whichever module logs; with tracing on, so do the
trace and span ids of the span current there (utils/tracing.py).

Both formatters escape control characters in the message and in every extra (``safe``): a path, a header
or a model name from a client cannot start a line of its own, forge another logger's line, or hide text
with terminal escapes or bidirectional overrides. It is done here, where every line is written, so no
caller can forget it; tracebacks (written by the formatter, not by a client) keep their lines.
"""

from __future__ import annotations

import contextvars
import logging
import logging.config
import re
import time
from collections.abc import Mapping
from typing import Any

import orjson

from inferd.utils import tracing

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Attributes every LogRecord has; anything else on a record came in through ``extra=`` and is logged.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName", "color_message"}


# C0 (CR, LF, ESC ...), DEL and C1 (NEL ...), the Unicode line and paragraph separators, and the
# bidirectional controls that reorder what a terminal shows.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe(value: Any) -> Any:
    """``value`` with every unsafe character of its text written as an escape (``\\x0a``, ``\\u2028``).

    Strings, and strings inside lists, tuples and dicts, are escaped; numbers, booleans and None pass as
    they are; anything else is escaped as its ``str()``.
    """
    if isinstance(value, str):
        return _UNSAFE.sub(_escape, value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {safe(k): safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [safe(v) for v in value]
    return _UNSAFE.sub(_escape, str(value))


def safe_lines(text: str) -> str:
    """Multi-line text of our own (a traceback, whose messages may quote a client): lines kept, each made safe."""
    return "\n".join(safe(line) for line in text.split("\n"))


def record_extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


def safe_extras(record: logging.LogRecord) -> dict[str, Any]:
    return {safe(k): safe(v) for k, v in record_extras(record).items()}


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        if not hasattr(record, "trace_id"):
            ids = tracing.current_ids()  # None when tracing is off: no key at all then
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "message": safe(record.getMessage()),
            "module": record.module,
            "logger": record.name,
        }
        line.update(safe_extras(record))
        if record.exc_info:
            line["exception"] = safe_lines(self.formatException(record.exc_info))
        return orjson.dumps(line, default=safe).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # record.message was just rendered from msg % args by format(); only the client's part can be unsafe,
        # but which part that is is not known here, so all of it is escaped.
        record.message = safe(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        # Indented: no line of a traceback starts where a log line does, whatever an exception's message
        # quotes (a line-oriented reader takes indented lines as the continuation of the one above).
        return "\n".join("    " + safe(line) for line in super().formatException(ei).split("\n"))

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("    " + safe(line) for line in stack_info.split("\n"))

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = {k: v for k, v in safe_extras(record).items() if v is not None}
        if extras:
            text += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return text


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "filters": {"request_id": {"()": RequestIdFilter}},
            "formatters": {
                "json": {"()": JsonFormatter},
                "text": {"()": TextFormatter},
            },
            "handlers": {
                "stderr": {
                    "class": "logging.StreamHandler",
                    "formatter": fmt,
                    "filters": ["request_id"],
                    "stream": "ext://sys.stderr",
                }
            },
            "loggers": {
                "inferd": {"handlers": ["stderr"], "level": level, "propagate": False},
                # uvicorn's own lines in the same format; its access log is replaced by ours.
                "uvicorn": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
                "uvicorn.error": {"level": "INFO"},
                "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
            },
        }
    )
