"""Logging, configured once at start-up: JSON lines in prod, readable text in dev.

Library modules only call ``logging.getLogger(__name__)``; the request id travels in a context variable
so every line logged while serving a request carries it, whichever module logs.
"""

from __future__ import annotations

import contextvars
import logging
import logging.config
import time
from typing import Any

import orjson

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Attributes every LogRecord has; anything else on a record came in through ``extra=`` and is logged.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName", "color_message"}


def record_extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "message": record.getMessage(),
            "module": record.module,
            "logger": record.name,
        }
        line.update(record_extras(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = {k: v for k, v in record_extras(record).items() if v is not None}
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
