"""Logs, one record per line on stdout: JSON for log shippers, or ``time level logger: msg
key=value ...`` for eyes. Both carry the same fields; ``auto`` picks text on a terminal."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, TextIO

LogFormat = Literal["auto", "text", "json"]

# Attributes every LogRecord has; anything else was passed through ``extra=`` and is kept.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


_bound: ContextVar[Mapping[str, Any] | None] = ContextVar("log_fields", default=None)
"""Fields every record logged in this context carries (e.g. the agent's ``node``). Tasks
and threads (``asyncio.to_thread``) copy the context they are started in, so the actors an
agent starts inside :func:`bound` log with its fields, even when several agents share a
process (``fleetctl up``)."""


@contextmanager
def bound(**values: Any) -> Iterator[None]:
    """Within the block (and in every task or thread started in it), records carry
    ``values`` as fields, unless a record sets the same field itself."""
    token = _bound.set({**(_bound.get() or {}), **values})
    try:
        yield
    finally:
        _bound.reset(token)


class BoundFields(logging.Filter):
    """Adds the context's bound fields to each record as attributes (structured fields,
    never text in the message), so every handler and formatter sees them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_bound.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    """What both formats show: time, level, logger, msg, every ``extra`` field, and the
    exception as ``error``."""
    entry: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in vars(record).items():
        if key not in _STANDARD:
            entry[key] = value
    if record.exc_info:
        entry["error"] = formatter.formatException(record.exc_info)
    return entry


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(fields(record, self), default=str)


class TextFormatter(logging.Formatter):
    """``2026-01-02T03:04:05.678Z warning actors.runtime.bus: msg key=value ...``; values
    with spaces or quotes are quoted; a traceback follows on its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry = fields(record, self)
        error = entry.pop("error", None)
        line = f"{entry.pop('time')} {entry.pop('level'):<7} {entry.pop('logger')}: "
        line += entry.pop("msg")
        line += "".join(f" {key}={_text(value)}" for key, value in entry.items())
        return f"{line}\n{error}" if error else line


def _text(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        return json.dumps(text)
    return text


def formatter(log_format: LogFormat, stream: TextIO) -> logging.Formatter:
    """The formatter ``log_format`` names; ``auto`` is text when ``stream`` is a terminal."""
    if log_format == "text" or (log_format == "auto" and stream.isatty()):
        return TextFormatter()
    return JsonFormatter()


def setup(level: str = "info", log_format: LogFormat = "auto") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter(log_format, sys.stdout))
    handler.addFilter(BoundFields())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # nats-py logs every reconnect attempt at error level; ours say it once, clearly.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
